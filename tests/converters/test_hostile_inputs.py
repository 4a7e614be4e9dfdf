"""`modelfleet convert` on malformed and hostile checkpoints: every failure is one `error:` line, a failed
JSON summary with the reason, the documented exit code, and no artifact; nothing outside the checkpoint is
read and nothing outside --out is written."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from modelfleet.cli.commands import main
from modelfleet.converters import candidates, validate
from modelfleet.converters.cli import EXIT_CODES, add_parser
from safetensors.torch import load_file, save_file


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """The real `modelfleet` entry point in-process: (exit code, stdout, stderr)."""
    try:
        code = main(["convert", *args])
    except SystemExit as exc:  # argparse's way out
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_failed(code: int, out: str, err: str, expected_code: int, reason: str) -> dict:
    assert code == expected_code, err
    assert "Traceback" not in err and "Traceback" not in out
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: "), err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] is False and reason in summary["reason"], summary
    assert errors[0] == f"error: {summary['reason']}"
    return summary


def artifacts(folder: Path) -> list[str]:
    """What a failed run left beside --out (the download cache aside)."""
    return (
        sorted(p.name for p in folder.iterdir() if p.name != ".modelfleet-cache") if folder.exists() else []
    )


# --- malformed checkpoints ---------------------------------------------------------------------------------


def write_header(folder: Path, header: object, tail: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + tail)


def edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def edit_weights(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, str(folder / "model.safetensors"))


def replace_with_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


_PATCH = pytest.MonkeyPatch()  # undone after each case


def unreadable(path: Path) -> None:
    path.chmod(0)
    if os.geteuid() == 0:  # root reads any file whatever its mode; make the read itself fail
        real = io.open

        def refusing(file, *args, **kwargs):
            if str(file) == str(path):
                raise PermissionError(13, "Permission denied", str(path))
            return real(file, *args, **kwargs)

        _PATCH.setattr(io, "open", refusing)


# name -> (how to break a copy of the tiny model, exit code, what the reason says)
CASES: dict[str, tuple[Callable[[Path], None], int, str]] = {
    "empty folder": (lambda d: [p.unlink() for p in d.iterdir()], 2, "has no config.json"),
    "config.json is bad JSON": (
        lambda d: (d / "config.json").write_text("{not json"), 2, "config.json is not valid JSON"
    ),
    "config.json is a folder": (
        lambda d: replace_with_folder(d / "config.json"), 2, "config.json is a folder, not a regular file"
    ),
    "unknown architecture": (
        lambda d: edit_config(d, architectures=["GPT2LMHeadModel"]), 2,
        "architecture 'GPT2LMHeadModel' is not supported",
    ),
    "config value of the wrong type": (
        lambda d: edit_config(d, rms_norm_eps="small"), 2, "config.json has a value of the wrong type"
    ),
    "index is bad JSON": (
        lambda d: (d / "model.safetensors.index.json").write_text("{"), 2,
        "model.safetensors.index.json is not valid JSON",
    ),
    "index weight_map is a list": (
        lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": ["model.safetensors"]}'),
        2, "has no 'weight_map' object",
    ),
    "index names a number": (
        lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {"x": 5}}'), 2,
        "5 is not a plain file name",
    ),
    "truncated safetensors": (
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-1000]), 2,
        "model.safetensors is truncated or corrupt",
    ),
    "huge header length": (
        lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**63) + b"{}"), 2,
        "past the end of the file or over 100 MB",
    ),
    "header is a list": (lambda d: write_header(d, [1, 2]), 2, "not a valid safetensors file"),
    "unknown tensor dtype": (
        lambda d: write_header(d, {"x": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
        2, "not a valid safetensors file",
    ),
    "missing tensor": (
        lambda d: edit_weights(d, lambda w: w.pop("model.norm.weight")), 2,
        "missing tensor 'model.norm.weight'",
    ),
    "wrong shape": (
        lambda d: edit_weights(d, lambda w: w.update({"model.embed_tokens.weight": torch.zeros(3, 3)})), 2,
        "'model.embed_tokens.weight' has shape [3, 3]; config.json implies [512, 64]",
    ),
    "integer weights": (
        lambda d: edit_weights(d, lambda w: w.update({"model.norm.weight": torch.ones(64).int()})),
        2, "'model.norm.weight' has dtype I32",
    ),
    "tensor the architecture lacks": (
        lambda d: edit_weights(d, lambda w: w.update({"extra.weight": torch.zeros(2)})), 2,
        "has tensor 'extra.weight'",
    ),
    "weights file is a folder": (
        lambda d: replace_with_folder(d / "model.safetensors"), 2, "model.safetensors is a folder"
    ),
    "weights file is a FIFO": (
        lambda d: ((d / "model.safetensors").unlink(), os.mkfifo(d / "model.safetensors")), 2,
        "model.safetensors is a FIFO, not a regular file",
    ),
    "weights file is unreadable": (
        lambda d: unreadable(d / "model.safetensors"), 2, "model.safetensors in",
    ),
    "tokenizer.json is bad JSON": (
        lambda d: (d / "tokenizer.json").write_text("{bad"), 2, "tokenizer.json cannot be loaded"
    ),
    "generation_config.json is bad JSON": (
        lambda d: (d / "generation_config.json").write_text("{bad"), 2, "generation_config.json"
    ),
}  # fmt: skip


@pytest.mark.timeout(120)  # a FIFO opened for reading would hang: fail instead
@pytest.mark.parametrize("case", list(CASES))
def test_malformed_checkpoint_fails_in_one_line_with_a_summary(case, tiny_model_dir, tmp_path, capsys):
    break_it, expected_code, reason = CASES[case]
    source = tmp_path / "source"
    shutil.copytree(tiny_model_dir, source)
    try:
        break_it(source)
        log = tmp_path / "termination-log"
        out = tmp_path / "out" / "cpu-fp32"
        code, stdout, err = run_main(
            capsys, "--source", str(source), "--target", "cpu", "--dtype", "fp32", "--out", str(out),
            "--termination-log", str(log),
        )  # fmt: skip
    finally:
        _PATCH.undo()
    summary = assert_failed(code, stdout, err, expected_code, reason)
    assert json.loads(log.read_text()) == summary
    assert artifacts(out.parent) == []


def test_every_exit_code_is_in_the_help(capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="modelfleet")
    add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["convert", "--help"])
    text = capsys.readouterr().out
    assert "exit codes:" in text and "MODELFLEET_SOURCE_ALLOW_HOSTS" in text
    for code, meaning in EXIT_CODES.items():
        assert f"  {code:<4} {meaning}" in text


def test_argument_errors_also_print_the_summary(tmp_path, capsys, monkeypatch):
    log = tmp_path / "termination-log"
    monkeypatch.setenv("MODELFLEET_TERMINATION_LOG", str(log))
    code, out, err = run_main(
        capsys, "--source", "x", "--target", "nvidia-h999", "--out", str(tmp_path / "o")
    )
    summary = assert_failed(code, out, err, 2, "argument --target: invalid choice: 'nvidia-h999'")
    assert json.loads(log.read_text()) == summary and summary["accelerator"] is None


# --- confinement -------------------------------------------------------------------------------------------


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret.json"
    path.write_text('{"token": "do-not-copy"}')
    return path


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json", "model.safetensors"])
def test_symlink_out_of_the_checkpoint_is_refused_naming_the_file(
    name, tiny_model_dir, tmp_path, secret, capsys
):
    source = tmp_path / "source"
    shutil.copytree(tiny_model_dir, source)
    (source / name).unlink()
    (source / name).symlink_to(secret)
    out = tmp_path / "out" / "a"
    code, stdout, err = run_main(capsys, "--source", str(source), "--target", "cpu", "--out", str(out))
    assert_failed(code, stdout, err, 2, f"{name} is a symlink to {secret}, outside the model folder")
    assert artifacts(out.parent) == []


def test_symlink_inside_the_checkpoint_is_followed(tiny_model_dir, tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(tiny_model_dir, source)
    (source / "generation_config.json").rename(source / "generation.json")
    (source / "generation_config.json").symlink_to("generation.json")
    out = tmp_path / "out"
    code, _, err = run_main(
        capsys, "--source", str(source), "--target", "cpu", "--dtype", "fp32", "--out", str(out)
    )
    assert code == 0, err
    assert (out / "generation_config.json").read_text() == (source / "generation.json").read_text()
    assert not (out / "generation_config.json").is_symlink()


@pytest.mark.parametrize(
    "shard",
    ["../../x.safetensors", "/etc/x.safetensors", "sub\\x.safetensors", "x\0.safetensors", "..",
     ".h.safetensors", "config.json"],
)  # fmt: skip
def test_index_shard_names_are_plain_safetensors_file_names(shard, tiny_model_dir, tmp_path, capsys):
    source = tmp_path / "deep" / "er" / "source"
    shutil.copytree(tiny_model_dir, source)
    index = {"weight_map": {"model.embed_tokens.weight": shard}}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "deep" / "x.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    out = tmp_path / "out" / "a"
    code, stdout, err = run_main(capsys, "--source", str(source), "--target", "cpu", "--out", str(out))
    reason = "is not a .safetensors file" if shard == "config.json" else "is not a plain file name"
    assert_failed(code, stdout, err, 2, reason)
    assert artifacts(out.parent) == [] and not list(tmp_path.glob("deep/*.safetensors.*"))


# --- nothing partial is published --------------------------------------------------------------------------


def test_an_error_mid_conversion_removes_the_staging_folder(tiny_model_dir, tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        assert list(tmp_path.glob("out/.a.tmp-*/model.safetensors")), "the weights were staged"
        raise RuntimeError("the validator broke\nsecond line")

    monkeypatch.setattr(validate, "compare", broken)
    out = tmp_path / "out" / "a"
    code, stdout, err = run_main(
        capsys, "--source", str(tiny_model_dir), "--target", "cpu", "--out", str(out)
    )
    assert_failed(code, stdout, err, 1, "unexpected RuntimeError: the validator broke")
    assert artifacts(out.parent) == []


def test_sigterm_mid_conversion_removes_the_staging_folder(tiny_model_dir, tmp_path, capsys, monkeypatch):
    real = candidates.torch_candidate

    def terminated(*args, **kwargs):
        assert list(tmp_path.glob("out/.a.tmp-*/model.safetensors")), "the weights were staged"
        os.kill(os.getpid(), signal.SIGTERM)  # what the kubelet sends at a Job's deadline
        return real(*args, **kwargs)

    monkeypatch.setattr(candidates, "torch_candidate", terminated)
    out = tmp_path / "out" / "a"
    before = signal.getsignal(signal.SIGTERM)
    code, stdout, err = run_main(
        capsys, "--source", str(tiny_model_dir), "--target", "cpu", "--out", str(out)
    )
    assert_failed(code, stdout, err, 143, "terminated (SIGTERM)")
    assert artifacts(out.parent) == []
    assert signal.getsignal(signal.SIGTERM) == before


def test_staging_left_by_a_killed_run_is_removed(tiny_model_dir, tmp_path, capsys):
    stale = tmp_path / "out" / ".a.tmp-killed"
    (stale / "half").mkdir(parents=True)
    (stale / "half" / "model.safetensors").write_bytes(b"partial")
    other = tmp_path / "out" / ".b.tmp-running"  # another --out's staging is not ours to remove
    other.mkdir()
    out = tmp_path / "out" / "a"
    code, _, err = run_main(
        capsys, "--source", str(tiny_model_dir), "--target", "cpu", "--dtype", "fp32", "--out", str(out)
    )
    assert code == 0, err
    assert artifacts(out.parent) == [".b.tmp-running", "a"]


def test_refused_host_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MODELFLEET_SOURCE_ALLOW_HOSTS", raising=False)
    connects = []
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: connects.append(a) or 1 / 0)
    out = tmp_path / "out" / "a"
    code, stdout, err = run_main(
        capsys, "--source", "http://169.254.169.254/latest/", "--target", "cpu", "--out", str(out)
    )
    assert_failed(code, stdout, err, 2, "169.254.169.254, a link-local address")
    assert connects == [] and artifacts(out.parent) == [] and not (out.parent / ".modelfleet-cache").exists()


@pytest.mark.parametrize("where", ["under a file", "is a FIFO"])
def test_unusable_out_is_refused_before_any_work(where, tiny_model_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    out = tmp_path / "file" / "a" / "b" if where == "under a file" else tmp_path / "fifo"
    reason = (
        f"lies under {tmp_path / 'file'}, which is not a folder"
        if where == "under a file"
        else ("exists and is not a folder")
    )
    code, stdout, err = run_main(
        capsys, "--source", str(tiny_model_dir), "--target", "cpu", "--out", str(out)
    )
    assert_failed(code, stdout, err, 2, reason)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "file"]
