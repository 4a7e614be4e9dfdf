"""The local quickstart behind `make run`: two demo versions, a 50/50 manifest, a server on localhost:8000.

    python -m modelfleet.dataplane.quickstart --dir .modelfleet/demo [--size small|tiny] [--port 8000]

The manifest is watched: edit the weights in DIR/manifest.yaml and the split changes without a restart.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

MODEL_NAME = "demo"
# A small KV cache keeps two CPU versions within a laptop's memory.
ENGINE = {"kv_cache_bytes": 256 * 1024 * 1024, "max_model_len": 1024}


def write_manifest(directory: Path, v1: Path, v2: Path) -> Path:
    from modelfleet.dataplane.manifest import ServedModel, ServedVersion, ServingManifest

    manifest = ServingManifest(
        models=[
            ServedModel(
                name=MODEL_NAME,
                versions=[
                    ServedVersion(name="v1", weight=50, artifact=str(v1.resolve()), preload=True),
                    ServedVersion(name="v2", weight=50, artifact=str(v2.resolve()), preload=True),
                ],
                engine=dict(ENGINE),
            )
        ]
    )
    path = directory / "manifest.yaml"
    path.write_text(manifest.to_yaml())
    return path


def examples(host: str, port: int) -> str:
    base = f"http://{host}:{port}"
    return f"""
Try it (the x-modelfleet-version header says which version answered):

  curl -si {base}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{MODEL_NAME}", "prompt": "Once upon a time", "max_tokens": 16}}'

  curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{MODEL_NAME}@v2", "messages": [{{"role": "user", "content": "Hi!"}}], "stream": true}}'

  python - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="unused")
  reply = client.chat.completions.create(
      model="{MODEL_NAME}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=16
  )
  print(reply.choices[0].message.content)
  EOF

Readiness {base}/ready, metrics {base}/metrics. The demo weights are random: expect gibberish.
"""


def _demo_version(path: Path, size: str, seed: int) -> Path:
    """Create a demo version once; a later run reuses it (the demo writer publishes folders whole)."""
    from modelfleet.dataplane.demo import create_demo_model

    if (path / "model.safetensors").is_file():
        return path
    return create_demo_model(path, size=size, seed=seed, force=True)


def _print_when_ready(dataplane, host: str, port: int) -> None:
    """The examples come after the start-up log lines, once both versions are loaded."""
    while not dataplane.readiness()[0]:
        time.sleep(0.5)
    print(examples(host, port), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(".modelfleet/demo"), help="where the demo lives")
    parser.add_argument("--size", choices=["small", "tiny"], default="small", help="demo model size")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)

    import uvicorn
    from modelfleet.dataplane.manifest import load_manifest
    from modelfleet.dataplane.observability import configure_logging
    from modelfleet.dataplane.server.runtime import build_app
    from modelfleet.dataplane.server.settings import ServerSettings

    configure_logging("INFO")
    args.dir.mkdir(parents=True, exist_ok=True)
    print(
        f"creating the {args.size} demo model, two versions (seeds 0 and 1) under {args.dir} ...", flush=True
    )
    v1, v2 = (_demo_version(args.dir / f"{args.size}-v{seed + 1}", args.size, seed) for seed in (0, 1))
    manifest_path = write_manifest(args.dir, v1, v2)
    print(f"manifest: {manifest_path} (model '{MODEL_NAME}', versions v1 and v2 at 50/50)", flush=True)

    settings = ServerSettings(host=args.host, port=args.port)
    app = build_app(settings, load_manifest(manifest_path), manifest_path=manifest_path)

    waiter = threading.Thread(
        target=_print_when_ready, args=(app.state.dataplane, args.host, args.port), daemon=True
    )
    waiter.start()
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
