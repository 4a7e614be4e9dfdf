"""`modelfleet local up|apply|delete|status|down`: a model.yaml's fleet on this machine.

`up -f FILE` runs the fleet in the foreground until Ctrl-C (or `down` from another shell); while one runs
in the work dir, `up`, `apply` and `delete` hand their objects to it. Production stays on Kubernetes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_WORK_DIR = Path(".modelfleet") / "local"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    local = subparsers.add_parser(
        "local",
        help="run a model.yaml's fleet on this machine (converters, servers, endpoint)",
        description="Run the InferenceModels and ModelVersions of a model.yaml on this machine: the "
        "operator's own reconcile decides what runs; conversion Jobs and data-plane pods run as local "
        "processes, each Service is an endpoint on 127.0.0.1. For trying a model.yaml before applying it "
        "to a cluster; production stays on Kubernetes.",
    )
    actions = local.add_subparsers(dest="local_command", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start the fleet (foreground) or hand FILE to the running one")
    apply = actions.add_parser("apply", help="apply FILE to the running fleet (a traffic edit applies live)")
    delete = actions.add_parser("delete", help="delete FILE's objects (or KIND NAME) from the running fleet")
    status = actions.add_parser("status", help="the models and versions, like kubectl get im,mv")
    down = actions.add_parser("down", help="stop the fleet and every process it started")
    for parser in (up, apply, delete, status, down):
        parser.add_argument(
            "--work-dir",
            type=Path,
            default=DEFAULT_WORK_DIR,
            help=f"the fleet's folder: state, pods, logs (default: {DEFAULT_WORK_DIR})",
        )
    for parser in (up, apply):
        parser.add_argument("-f", "--filename", type=Path, required=True, help="model.yaml")
    delete.add_argument("-f", "--filename", type=Path, help="model.yaml whose objects to delete")
    delete.add_argument("kind", nargs="?", help="im | mv | inferencemodel | modelversion")
    delete.add_argument("name", nargs="?", help="the object's name")
    up.add_argument(
        "--pvc-root",
        type=Path,
        help="folder of the PVCs: pvc://CLAIM/PATH is PVC_ROOT/CLAIM/PATH (default: WORK_DIR/pvc)",
    )
    up.add_argument(
        "--port", type=int, default=8000, help="the first model's endpoint port (0: any free one)"
    )
    up.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    status.add_argument("-o", "--output", choices=["wide"], help="wide: every printer column")
    status.add_argument(
        "--events", action="store_true", help="also the latest Events, like kubectl get events"
    )
    up.set_defaults(func=run_up)
    apply.set_defaults(func=run_apply)
    delete.set_defaults(func=run_delete)
    status.set_defaults(func=run_status)
    down.set_defaults(func=run_down)


def load_documents(path: Path) -> list[Any]:
    import yaml

    try:
        return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None


def run_up(args: argparse.Namespace) -> int:
    from modelfleet.local import state
    from modelfleet.local.admission import admit

    docs = load_documents(args.filename)
    for doc in docs:
        admit(doc)  # refused as the API server would, before anything starts
    if state.running_pid(args.work_dir) is not None:
        return _hand_over(args.work_dir, "apply", docs)
    from modelfleet.local.fleet import Fleet

    _check_port(args.port)

    from modelfleet.dataplane.observability import configure_logging

    configure_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness probe otherwise
    fleet = Fleet(args.work_dir, pvc_root=args.pvc_root, port=args.port)

    def on_signal(signum: int, _: Any) -> None:
        fleet.request_stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    fleet.start()
    try:
        for line in fleet.apply(docs):
            print(line, flush=True)
        stops = "Ctrl-C or `modelfleet local down` stops it"
        print(f"local fleet in {args.work_dir} (pid {os.getpid()}); {stops}", flush=True)
        announced: set[str] = set()
        while not fleet.stopping:
            for key, proxy in list(fleet.proxies.items()):
                if key[1] not in announced:
                    announced.add(key[1])
                    print(
                        f"model {key[1]}: {proxy.url}/v1 (OpenAI API; ready when `status` says so)",
                        flush=True,
                    )
            time.sleep(0.5)
    finally:
        print("stopping the local fleet ...", file=sys.stderr, flush=True)
        fleet.stop()
    return 1 if fleet.error else 0


def _check_port(port: int) -> None:
    """The endpoint's port must be free before anything starts."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ValueError(
                f"--port {port}: 127.0.0.1:{port} is taken ({exc.strerror}); pick another"
            ) from None


def _hand_over(work_dir: Path, op: str, docs: list[Any]) -> int:
    from modelfleet.local import state

    result = state.submit(work_dir, op, docs)
    if not result.get("ok"):
        raise ValueError(result.get("message", "refused"))
    for line in result.get("lines", []):
        print(line)
    return 0


def run_apply(args: argparse.Namespace) -> int:
    from modelfleet.local.admission import admit

    docs = load_documents(args.filename)
    for doc in docs:
        admit(doc)
    return _hand_over(args.work_dir, "apply", docs)


KINDS = {"im": "InferenceModel", "inferencemodel": "InferenceModel", "inferencemodels": "InferenceModel",
         "mv": "ModelVersion", "modelversion": "ModelVersion", "modelversions": "ModelVersion"}  # fmt: skip


def run_delete(args: argparse.Namespace) -> int:
    if args.filename is not None:
        docs = load_documents(args.filename)
    elif args.kind and args.name:
        kind = KINDS.get(args.kind.lower())
        if kind is None:
            raise ValueError(f"kind {args.kind!r} is unknown; use im or mv")
        docs = [{"kind": kind, "metadata": {"name": args.name}}]
    else:
        raise ValueError("give -f FILE or KIND NAME")
    return _hand_over(args.work_dir, "delete", docs)


def run_status(args: argparse.Namespace) -> int:
    from modelfleet.local import state
    from modelfleet.local.columns import events_table, table

    found = state.read(args.work_dir)
    if not found or state.running_pid(args.work_dir) is None:
        print(f"no local fleet runs in {args.work_dir}", file=sys.stderr)
        return 1
    objects = found.get("objects", [])
    tables = [table(kind, objects, wide=args.output == "wide") for kind in ("InferenceModel", "ModelVersion")]
    print("\n\n".join(t for t in tables if t) or "no resources")
    for name, url in sorted(found.get("endpoints", {}).items()):
        print(f"\nendpoint {name}: {url}")
    if args.events:
        print("\n" + (events_table(found.get("events", [])) or "no events"))
    return 0


def run_down(args: argparse.Namespace) -> int:
    from modelfleet.local import processes, state

    found = state.read(args.work_dir) or {}
    pid = state.running_pid(args.work_dir)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 90
        while processes.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    # Whatever the supervisor could not stop (it was killed, or timed out): stop it here.
    left = [
        p["pid"]
        for p in (found.get("pods") or {}).values()
        if p.get("pid") and processes.group_alive(p["pid"])
    ]
    for pgid in left:
        processes.stop_group(pgid, grace=5)
    if pid:
        print(f"local fleet in {args.work_dir} stopped")
    elif left:
        print(f"stopped {len(left)} process group(s) left by a local fleet in {args.work_dir} that had died")
    else:
        print(f"no local fleet ran in {args.work_dir}")
    return 0
