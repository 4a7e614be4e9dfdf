"""Write docs/settings.md from the settings classes of the three services (`--check`: exit 1 when stale).

The classes are the one source of each setting's name, type, default and meaning; this page is rendered
from them so that it cannot drift.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic_settings import BaseSettings

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
HEADER = """# Settings

Generated from the settings classes by `python scripts/settings_reference.py`; a test keeps it current.
Every setting is an environment variable. The chart sets those of the operator and the control plane
from its values; the operator sets the data plane's in the pods it makes. Each component has its own
names (the data plane `MODELFLEET_`, the control plane `MODELFLEET_CONTROLPLANE_`, the operator's topics
`MODELFLEET_OPERATOR_`, `MODELFLEET_DATAPLANE_`, ...); a test fails if two components read one name.

## Every component

| variable | meaning |
|---|---|
{shared}

With no exporter, no span is recorded. The rule is `dataplane/observability.py`'s, for all three.

## The engine

Read by the engine wherever it runs (a server's engine process, `modelfleet.dataplane.LLM`), from the
environment, not a settings class.

| variable | meaning |
|---|---|
{engine}
"""


SHARED = [
    (
        "`MODELFLEET_LOG_FORMAT`",
        "`text` (the default) or `json`: one JSON object a line with time, level, logger, message, "
        "and trace_id/span_id when a span is current",
    ),
    (
        "`OTEL_TRACES_EXPORTER`",
        "`otlp`, `console` or `none` (comma-separated); unset: `otlp` when an OTLP endpoint is set, "
        "else none",
    ),
    (
        "`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`",
        "where OTLP/HTTP spans go (and the exporter's other `OTEL_EXPORTER_OTLP_*` settings)",
    ),
    ("`OTEL_SDK_DISABLED`", "`true`: no spans, whatever else is set"),
    (
        "`OTEL_SERVICE_NAME`",
        "the service name on spans (default `modelfleet-server`, `-operator`, `-controlplane`)",
    ),
]


ENGINE = [
    (
        "`MODELFLEET_GRAMMARS`",
        "`process` or `thread`: where an engine's structured-output grammars live, a process of their "
        "own (engine/grammar_process.py) or the engine's; unset: a process of their own where decode "
        "steps sample in CUDA graphs (a GPU's), else the engine's",
    ),
    (
        "`MODELFLEET_GRAMMAR_THREADS`",
        "threads filling a step's grammar bitmask; `auto` (the default): 2 in a grammar process, "
        "xgrammar's (half the cores) in the engine's",
    ),
    (
        "`MODELFLEET_PDL`",
        "`0`: no programmatic dependent launch in the Triton kernels (default on where supported)",
    ),
    (
        "`MODELFLEET_CPU_DTYPE`",
        "`float32` or `bfloat16`: a CPU engine's dtype; unset: bfloat16 where the CPU has it natively",
    ),
    (
        "`MODELFLEET_CPU_THREADS`",
        "threads a CPU engine computes with; unset: the usable CPUs that other work leaves idle",
    ),
]


def _classes() -> list[tuple[str, str, type[BaseSettings]]]:
    from modelfleet.controlplane.core.config import Settings
    from modelfleet.dataplane.server.settings import ServerSettings
    from modelfleet.operator.settings import OperatorSettings

    return [
        ("Data plane (`modelfleet serve`)", "dataplane/server/settings.py", ServerSettings),
        ("Operator (`modelfleet operator`)", "operator/settings.py", OperatorSettings),
        ("Control plane (`modelfleet controlplane`)", "controlplane/core/config.py", Settings),
    ]


def _default(field: Any) -> str:
    if field.default_factory is not None:
        return "(computed)"
    value = field.default
    if hasattr(value, "get_secret_value"):
        return "(a development secret; set it in production)"
    return "(none)" if value is None or value == "" else f"`{value}`"


def _type(field: Any) -> str:
    if get_origin(field.annotation) is Literal:  # the allowed values say more than "Literal"
        return " or ".join(f"`{value}`" for value in get_args(field.annotation))
    text = getattr(field.annotation, "__name__", None) or str(field.annotation)
    text = text.replace("typing.", "").replace("pathlib.", "").replace("pydantic.types.", "")
    return text.replace("|", "or")


def render() -> str:
    rows = {
        key: "\n".join(f"| {name} | {meaning} |" for name, meaning in table)
        for key, table in (("shared", SHARED), ("engine", ENGINE))
    }
    parts = [HEADER.format(**rows)]
    for title, source, cls in _classes():
        prefix = cls.model_config.get("env_prefix", "")
        parts.append(f"\n## {title}\n\nFrom `{source}`.\n\n")
        parts.append("| variable | type | default | meaning |\n|---|---|---|---|\n")
        for name, field in cls.model_fields.items():
            meaning = (field.description or "").replace("|", "\\|")
            parts.append(f"| `{prefix}{name.upper()}` | {_type(field)} | {_default(field)} | {meaning} |\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when docs/settings.md is stale"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is stale; run `python scripts/settings_reference.py`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
