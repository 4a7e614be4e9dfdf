"""One conversion: source -> staged artifact -> validated -> manifest.json -> published by rename."""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from modelfleet.converters import artifact, candidates, preflight, progress, sources, validate
from modelfleet.converters.checkpoint import (
    TORCH_DTYPES,
    Checkpoint,
    copy_side_files,
    read_checkpoint,
    write_torch,
)
from modelfleet.converters.errors import BadInputError, ValidationFailedError
from modelfleet.converters.formats import Target, check_target, default_targets, hardware


@dataclass(frozen=True)
class Request:
    source: str
    accelerator: str
    out: Path
    format: str | None = None
    dtype: str | None = None
    sha256: str | None = None
    cache_dir: Path | None = None
    force: bool = False
    quantize_lm_head: bool = False  # int8/fp8 torch targets only


def resolve_target(accelerator: str, format: str | None, dtype: str | None) -> Target:
    """Fill a missing format or dtype from the hardware table, then check the pair against it."""
    try:
        hw = hardware(accelerator)
        if format is None and dtype is None:
            return default_targets(accelerator, "none")[0]
        if format is None:
            quantized = dtype in ("int8", "fp8") and dtype in hw.dtypes
            format = default_targets(accelerator, dtype)[-1].format if quantized else "torch"
            if format not in hw.formats:
                format = hw.formats[0]
        if dtype is None:
            from modelfleet.converters.formats import FORMAT_DTYPES

            dtype = next((d for d in hw.dtypes if d in FORMAT_DTYPES.get(format, ())), hw.dtypes[0])
        return check_target(accelerator, format, dtype)
    except ValueError as exc:
        raise BadInputError(str(exc)) from None


def serving_dtype(accelerator: str) -> str:
    """The float dtype the hardware computes in: the non-quantized tensors of int8/fp8 artifacts use it."""
    return next(d for d in hardware(accelerator).dtypes if d in ("bf16", "fp16", "fp32"))


def convert(request: Request) -> dict:
    """Run the conversion and return the summary dict; raises ConversionError subclasses on failure."""
    target = resolve_target(request.accelerator, request.format, request.dtype)
    if request.quantize_lm_head and not target.quantized_torch:
        raise BadInputError(
            f"--quantize-lm-head applies to torch int8/fp8 targets, not {target.format} {target.dtype}"
        )
    out = request.out.absolute()
    if out.exists() and not out.is_dir():
        raise BadInputError(f"--out {out} exists and is not a folder; choose another path")
    artifact.check_parent(out)
    cache_dir = request.cache_dir or out.parent / ".modelfleet-cache"
    source = sources.resolve(request.source, cache_dir=cache_dir, sha256=request.sha256)

    # A retried Job finds its own finished artifact: report it again instead of redoing the work.
    previous = artifact.existing_manifest(out)
    same = previous and _same_artifact(previous, source.digest, target, request.quantize_lm_head)
    if same and not request.force:
        progress.log(f"{out} already holds this conversion; nothing to do")
        return artifact.summary(
            ok=True, target=target.as_dict(), manifest=previous, uri=artifact.artifact_uri(out),
            validation=previous.get("validation"),
        )  # fmt: skip
    artifact.check_destination(out, request.force)

    ckpt = read_checkpoint(source.path)
    token_ids = preflight.check(ckpt)  # what would fail later with a library's traceback fails here
    staging = artifact.staging_dir(out)
    try:  # whatever happens (an error, Ctrl-C, SIGTERM), the staging folder goes and nothing is published
        started = time.monotonic()
        onnx_cache = cache_dir / f"onnx-fp32-{source.digest.removeprefix('sha256:')[:16]}"
        _build(ckpt, target, staging, request.quantize_lm_head, onnx_cache)
        conversion_seconds = time.monotonic() - started
        started = time.monotonic()
        validation = _validate(ckpt, target, staging, token_ids)
        validation["seconds"] = round(time.monotonic() - started, 2)
        if not validation["passed"]:
            raise ValidationFailedError(
                f"validation failed for {target.format} {target.dtype}: {'; '.join(validation['failures'])}",
                validation,
            )
        fields = {
            **target.as_dict(),
            "source": {"uri": source.uri, "digest": source.digest, "architecture": ckpt.architecture},
            "conversionSeconds": round(conversion_seconds, 2),
            "validation": validation,
        }
        if target.dtype in ("int8", "fp8"):
            fields["quantization"] = {"format": target.dtype, "group": "per-channel", "symmetric": True}
            if request.quantize_lm_head:
                fields["quantization"]["lmHead"] = True
        manifest = artifact.write_manifest(staging, fields)
        artifact.publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    progress.log(f"published {target.format} {target.dtype} artifact for {target.accelerator} at {out}")
    return artifact.summary(
        ok=True,
        target=target.as_dict(),
        manifest=manifest,
        uri=artifact.artifact_uri(out),
        validation=validation,
    )


def _same_artifact(manifest: dict, digest: str, target: Target, lm_head: bool) -> bool:
    quantization = manifest.get("quantization") or {}
    return (
        manifest.get("source", {}).get("digest") == digest
        and all(manifest.get(k) == v for k, v in target.as_dict().items())
        and quantization.get("lmHead", False) == lm_head
    )


def _build(ckpt: Checkpoint, target: Target, staging: Path, lm_head: bool, onnx_cache: Path) -> None:
    if target.format == "torch":
        quant = target.dtype if target.dtype in ("int8", "fp8") else None
        write_torch(
            ckpt,
            staging,
            dtype=target.dtype,
            quant=quant,
            serving_dtype=serving_dtype(target.accelerator),
            quantize_lm_head=lm_head,
        )
        return
    from modelfleet.converters import onnx_export

    if target.format == "tensorrt":
        from modelfleet.converters import tensorrt_engine

        tensorrt_engine.require_tensorrt()  # fail before the slow export
        tensorrt_engine.build_engine(_fp32_onnx(ckpt, onnx_cache), staging, ckpt.model_config, target.dtype)
    elif target.dtype == "int8":
        onnx_export.quantize_onnx_int8(_fp32_onnx(ckpt, onnx_cache), staging)
    elif target.dtype == "fp32":
        for name in (onnx_export.MODEL_FILE, onnx_export.DATA_FILE):
            shutil.copyfile(_fp32_onnx(ckpt, onnx_cache) / name, staging / name)
    else:
        onnx_export.export_onnx(ckpt, staging, TORCH_DTYPES[target.dtype])
    shutil.copyfile(ckpt.path / "config.json", staging / "config.json")
    copy_side_files(ckpt.path, staging)


def _fp32_onnx(ckpt: Checkpoint, folder: Path) -> Path:
    """The float32 export every ONNX-derived target starts from, kept in the cache per source digest so
    the int8, fp32 and TensorRT targets of one version export once. Written to a temp name, then renamed."""
    from modelfleet.converters import onnx_export

    if (folder / onnx_export.DATA_FILE).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".onnx-") as scratch:
        onnx_export.export_onnx(ckpt, Path(scratch), torch.float32)
        shutil.rmtree(folder, ignore_errors=True)
        Path(scratch).rename(folder)
        Path(scratch).mkdir()  # for TemporaryDirectory's cleanup
    return folder


def _validate(
    ckpt: Checkpoint, target: Target, staging: Path, token_ids: tuple[list[list[int]], list[int]]
) -> dict:
    prompts, text = token_ids
    reference = validate.reference(ckpt.path)
    baseline = None
    if target.quantized_torch:
        if serving_dtype(target.accelerator) == validate.BASELINE_DTYPE:
            # the source in bf16 against the same reference: quantized artifacts are judged relative to it
            reference = validate.cached(reference)
            base, _ = candidates.torch_candidate(ckpt.path, validate.BASELINE_DTYPE)
            baseline = validate.measure_baseline(reference, base, prompts)
            del base
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        cand, how = candidates.quantized_candidate(
            staging, ckpt.path, target.dtype, serving_dtype(target.accelerator)
        )
    elif target.format == "torch":
        cand, how = candidates.torch_candidate(staging, target.dtype)
    elif target.format == "onnx":
        cand, how = candidates.onnx_candidate(staging)
    else:
        cand, how = candidates.tensorrt_candidate(staging)
    return {**how, **validate.compare(reference, cand, prompts, text, target.dtype, baseline)}
