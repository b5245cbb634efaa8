"""Every ``pipetrain`` command in the README and the docs runs as written.

Commands are read from the fenced blocks of ``README.md`` and ``docs/*.md`` (``$ `` and
trailing ``# comments`` stripped; ``[--option]`` run without and with it), in order, one
workspace per document. A block whose first line is a comment naming a file (``#
my_model.py``, ``# run.toml``, ``# my-1f1b.txt: ...``) is written to that file first, as a
reader would save it. ``pipetrain train`` and ``profile`` run at a reduced size: the model
shape, batch and step flags below are appended (the last flag wins), and a new ``--out``
per training run. Where a block shows a command's output, each shown line that is not
abbreviated (``...``) must appear in the real output.

Not run here: the set-up commands (CI runs them on a fresh clone), the torchrun lines for
several machines (tests/launch/test_multihost.py runs them between two network
namespaces) and the benchmark scripts (``pipetrain bench`` / ``benchmarks/``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.train_runs import run_here

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^\s*```(\w*)")
_NAMED = re.compile(r"^#\s*([\w.-]+\.(?:py|toml|txt))\b")
_SMALL_MODEL = ["--layers", "2", "--width", "32", "--heads", "4"]
"""Width and heads of the GPT of tests/api/test_pipeline_compile.py (``pipeline_jobs.GPT``),
which runs earlier: ``train --compile`` finds its layers' graphs in inductor's cache."""
_SMALL_RUN = ["--context", "16", "--batch-size", "8", "--steps", "2", "--eval-every", "0",
              "--sample-bytes", "0", "--warmup", "1"]

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@dataclass
class Command:
    where: str
    argv: list[str]
    shown: list[str] = field(default_factory=list)
    """Output lines the document shows for it."""


@dataclass
class Document:
    path: Path
    files: dict[str, str] = field(default_factory=dict)
    commands: list[Command] = field(default_factory=list)


def _without_comment(line: str) -> str:
    return re.split(r"\s#\s|\s{2,}#", line, maxsplit=1)[0].strip()


def _variants(text: str) -> list[str]:
    """``a [--b]`` -> ``a`` and ``a --b``."""
    optional = re.search(r"\s\[([^\]]+)\]", text)
    if optional is None:
        return [text]
    plain = text[:optional.start()] + text[optional.end():]
    full = text[:optional.start()] + " " + optional.group(1) + text[optional.end():]
    return [*_variants(plain), *_variants(full)]


def read(path: Path) -> Document:
    """The files and ``pipetrain`` commands a document's blocks hold, in order."""
    document = Document(path)
    lines = path.read_text().splitlines()
    block: list[tuple[int, str]] | None = None
    language = ""
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if fence and block is None:
            block, language = [], fence.group(1)
            continue
        if fence and block is not None:
            _take(document, block, language)
            block = None
            continue
        if block is not None:
            block.append((number, line))
    return document


_MESSAGE = re.compile(r"pipetrain [\w-]+: ")
"""A line the command prints (``pipetrain train: warning: ...``), not a command."""


def _take(document: Document, block: list[tuple[int, str]], language: str) -> None:
    if block:
        named = _NAMED.match(block[0][1].strip())
        if named is not None:
            document.files[named.group(1)] = "\n".join(text for _, text in block) + "\n"
            return
    if language == "python":
        return
    current: Command | None = None
    for number, raw in block:
        line = raw.strip()
        prompt = line.startswith("$ ")
        command = line[2:] if prompt else line
        if command.startswith("pipetrain bench"):  # the benchmarks: run by their own test
            continue
        if command.startswith("pipetrain ") and not _MESSAGE.match(command):
            for variant in _variants(_without_comment(command)):
                current = Command(f"{document.path.name}:{number}", shlex.split(variant)[1:])
                document.commands.append(current)
            if not prompt:
                current = None
            continue
        if current is not None and line and "..." not in line:
            current.shown.append(line)


def _make_shared_files(workspace: Path, document: Document) -> None:
    """What the documents' commands read and do not show how to make (``profile.json``
    only for a document whose commands or files read it: making it starts a profile)."""
    vgg = workspace / "vgg16"
    vgg.mkdir(exist_ok=True)
    vgg.joinpath("graph.txt").write_text("\n".join([  # PipeDream's graph.txt format
        "node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=0.0, parameter_size=0.000",
        "node2 -- Conv2d(3, 64) -- forward_compute_time=10.0, backward_compute_time=20.0, activation_size=4000000.0, parameter_size=7000.000",
        "node3 -- ReLU() -- forward_compute_time=1.0, backward_compute_time=1.0, activation_size=4000000.0, parameter_size=0.000",
        "node4 -- Linear(64, 10) -- forward_compute_time=50.0, backward_compute_time=50.0, activation_size=10.0, parameter_size=1000.000",
        "\tnode1 -- node2", "\tnode2 -- node3", "\tnode3 -- node4"]) + "\n")
    corpus = workspace / "corpus.txt"
    corpus.write_text((ROOT / "README.md").read_text())
    reads_profile = any("profile.json" in " ".join(c.argv) for c in document.commands) or any(
        "profile.json" in text for text in document.files.values())
    if reads_profile and not (workspace / "profile.json").exists():  # planner.md says how
        made = run_here(["profile", *_SMALL_MODEL, *_SMALL_RUN, "--microbatches", "2",
                         "--repetitions", "3", "--output", "profile.json"], cwd=workspace)
        assert made.returncode == 0, made.stderr[-2000:]


def _hf_folder(workspace: Path, name: str) -> None:
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=16, n_layer=2, n_head=2,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(workspace / name)


def _reduced(argv: list[str], index: int) -> list[str]:
    if not argv or argv[0] not in ("train", "profile"):
        return argv
    extra = list(_SMALL_RUN)
    if "--model" not in argv and "--config" not in argv:
        extra += _SMALL_MODEL
    schedule_file = "--schedule" in argv and argv[argv.index("--schedule") + 1].endswith(".txt")
    if "--plan" not in argv and not schedule_file:  # a plan or schedule file sets them
        extra += ["--microbatches", "2"]
    if argv[0] == "train" and "--out" not in argv:
        extra += ["--out", f"run-{index}"]
    return [*argv, *extra]


_RUN_ELSEWHERE = {
    "train --stages 2 --replicas 2 --fsdp --tensor-parallel 2 --steps 5":
        "tests/cli/test_train_mesh.py",
    "train --stages 2 --replicas 2 --fsdp --steps 5": "tests/cli/test_train_mesh.py",
    "train --model ./my-gpt2 --data corpus.txt --context 128": "tests/cli/test_user_workflow.py",
    "train --config run.toml --steps 4000": "tests/cli/test_user_workflow.py",
    "train --schedule 2bw": "tests/cli/test_train_async.py",
    "train --schedule pipedream --vertical-sync": "tests/cli/test_train_async.py",
}
"""Commands another test runs, with each of their flags, and checks more closely (the mesh
commands start 4 and 8 workers, the Hugging Face folder imports transformers in each:
most of a minute here; a TOML file's model trained from the file, with a flag that wins
over it; pipedream's vertical sync, whose options the asynchronous test resolves and whose
math the API's tests check, beside the plain pipedream run the document's test keeps); :func:`test_the_commands_run_elsewhere_are_run_there` holds
those tests to it."""


def _elsewhere(command: Command) -> str | None:
    return _RUN_ELSEWHERE.get(shlex.join(command.argv))


def _documents() -> list[Document]:
    return [d for d in map(read, DOCS) if d.commands]


@pytest.mark.parametrize("document", _documents(), ids=lambda d: d.path.name)
def test_every_command_of_the_document_runs_as_written(document: Document, tmp_path: Path) -> None:
    for name, text in document.files.items():
        (tmp_path / name).write_text(text)
    _make_shared_files(tmp_path, document)
    for command in document.commands:
        if _elsewhere(command) is not None:
            continue
        model = command.argv[command.argv.index("--model") + 1] if "--model" in command.argv else ""
        if model.startswith("./") and not (tmp_path / model).exists():
            _hf_folder(tmp_path, model)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), HF_HUB_OFFLINE="1")
    for index, command in enumerate(document.commands):
        if _elsewhere(command) is not None:
            continue
        argv = _reduced(command.argv, index)
        if argv[0] in _IN_PROCESS:
            code, stdout, stderr = _run_here(argv, tmp_path)
        else:
            done = subprocess.run([sys.executable, "-m", "pipetrain", *argv], cwd=tmp_path,
                                  env=env, capture_output=True, text=True, timeout=400)
            code, stdout, stderr = done.returncode, done.stdout, done.stderr
        assert code == 0, (
            f"{command.where}: pipetrain {shlex.join(argv)} exited {code}:\n"
            f"{stdout[-1500:]}\n{stderr[-2500:]}")
        for line in command.shown:
            assert line in stdout, f"{command.where}: shown {line!r} not in:\n{stdout[-2000:]}"


_IN_PROCESS = ("simulate", "plan", "profile")
"""Commands that start no worker: run through the CLI's ``main`` in this process (a
second or two of start-up saved each)."""


def _run_here(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    done = run_here(argv, cwd=cwd)
    return done.returncode, done.stdout, done.stderr


def test_the_reader_finds_the_commands_files_and_shown_output() -> None:
    """The extraction itself: a command with its shown output, optional flags, files."""
    readme = read(ROOT / "README.md")
    simulate = next(c for c in readme.commands if c.argv[:3] == ["simulate", "--schedule", "1f1b"])
    assert simulate.shown and simulate.shown[0].startswith("rank 0: F0 F1")
    asynchronous = read(ROOT / "docs" / "asynchronous.md")
    variants = [c.argv for c in asynchronous.commands if c.argv[:3] == ["train", "--schedule", "pipedream"]]
    assert variants == [["train", "--schedule", "pipedream"],
                        ["train", "--schedule", "pipedream", "--vertical-sync"]]
    schedules = read(ROOT / "docs" / "schedules.md")
    assert "my-1f1b.txt" in schedules.files and "rank 1:" in schedules.files["my-1f1b.txt"]


def test_the_commands_run_elsewhere_are_run_there() -> None:
    """Each command this test leaves to another is in a document, and that test passes
    each of its flags."""
    commands = {shlex.join(c.argv) for d in _documents() for c in d.commands}
    for command, test in _RUN_ELSEWHERE.items():
        assert command in commands, f"no document shows `pipetrain {command}` any more"
        text = (ROOT / test).read_text()
        for flag in (a for a in shlex.split(command) if a.startswith("--")):
            assert f'"{flag}"' in text, f"{test} does not pass {flag} of `pipetrain {command}`"
