"""Every job command shown to users (README.md, docs/*.md, infra/README.md, the RayJob entrypoints)
parses with the job's own parser, and every batch job it runs uses a method that keeps the answers
when the question comes after the context: ``none``, or one the README's "Which method" table
recommends (methods that lose the answers query-agnostically, such as ``criticalkv-adakv-snapkv``,
are not shown as examples)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pipeline.apps import batch_jobs
from pipeline.data import sample_qa_documents, write_documents
from tests.infra.infra_common import _load_k8s_docs
from tests.infra.kuberay_checks import _rayjob_entrypoints, parse_job_args

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "README.md", ROOT / "infra" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:\S*/)?python3? (?:/app/)?(jobs/[A-Za-z0-9_]+\.py)((?: .*)?)$")


def _shell_blocks(text: str) -> list[str]:
    """The bodies of the text's fenced code blocks that are shell (no language, bash, sh, console, shell)."""
    blocks, body, language = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if body is None:
                body, language = [], line[3:].strip()
            else:
                if language in ("", "bash", "sh", "console", "shell"):
                    blocks.append("\n".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """(script, arguments) of each ``python jobs/<x>.py ...`` line in the text's code blocks
    (continuations joined; comments, ``[optional ...]`` groups and ``...`` placeholders left out)."""
    out = []
    for block in _shell_blocks(text):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" #")[0].strip()
            match = COMMAND.search(line)
            if match:
                args = re.sub(r"\[[^\]]*\]", " ", match.group(2)).replace("...", " ")
                out.append((match.group(1), shlex.split(args)))
    return out


def all_examples() -> list[tuple[str, str, list[str]]]:
    found = [(str(p.relative_to(ROOT)), s, a) for p in SOURCES for s, a in _commands(p.read_text())]
    for entrypoint in _rayjob_entrypoints(_load_k8s_docs()):
        argv = shlex.split(entrypoint)
        found.append(("infra/k8s RayJob", argv[1].removeprefix("/app/"), argv[2:]))
    return found


def recommended_methods() -> set[str]:
    """``none`` and the methods named in the first column of the README's "Which method" table."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("### Which method") :].split("\n\n")[1]
    names = {m for line in table.splitlines()[2:] for m in re.findall(r"^\| `([a-z0-9_-]+)`", line)}
    assert names, "the README's 'Which method' table names no method"
    return names | {"none"}


EXAMPLES = all_examples()


def test_the_docs_show_batch_job_commands():
    scripts = {script for _, script, _ in EXAMPLES}
    assert {"jobs/longdoc_qa.py", "jobs/summarize.py"} <= scripts and len(EXAMPLES) >= 8


@pytest.mark.parametrize("where, script, args", EXAMPLES, ids=[f"{w}:{' '.join(a)[:60]}" for w, _, a in EXAMPLES])
def test_example_parses_and_keeps_answers_without_the_question(where, script, args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example's local input files, made here: the parser checks they exist
    if "--input" in args and "://" not in args[args.index("--input") + 1]:
        write_documents(sample_qa_documents(1, 40, 0), tmp_path / args[args.index("--input") + 1])
    namespace, message = parse_job_args(ROOT / script, args)
    assert namespace is not None, f"{where}: {script} {' '.join(args)}: {message}"
    job = Path(script).stem
    if job in ("longdoc_qa", "summarize"):
        config = batch_jobs.config_from_args(job, args)
        method = config.compression.method
        assert config.compression.query_aware or method in recommended_methods(), (
            f"{where}: {script} runs {method!r}, which the README does not recommend"
        )


def test_a_method_that_loses_the_answers_is_caught():
    assert "criticalkv-adakv-snapkv" not in recommended_methods()
    args = ["--method", "criticalkv-adakv-snapkv", "--cache-size", "0.2"]
    assert batch_jobs.config_from_args("longdoc_qa", args).compression.method not in recommended_methods()
    assert _commands("```bash\npython jobs/longdoc_qa.py --input a \\\n  --method x  # note\n```") == [
        ("jobs/longdoc_qa.py", ["--input", "a", "--method", "x"])
    ]
