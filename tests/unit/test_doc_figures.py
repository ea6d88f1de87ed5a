"""docs/rlhf.md's figures for the shipped tiny commands are what benchmarks/doc_figures.py measured: every
marked block equals its rendering of benchmarks/results/doc_figures.json, names its date and command, and
the README's job is one of the runs."""

from __future__ import annotations

import copy
import re
from pathlib import Path

from benchmarks import doc_figures

ROOT = Path(__file__).resolve().parents[2]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def test_every_run_has_a_dated_result_of_its_exact_command():
    results = doc_figures.load_results()
    for run in doc_figures.RUNS:
        r = results.get(run.name)
        assert r is not None, f"no stored result for {run.name}: python -m benchmarks.doc_figures --only {run.name}"
        assert r["command"] == run.command and DATE.fullmatch(r["date"]) and r["wall_s"] > 0
        assert r["code"]["commit"], "the result names the code version it measured"


def test_docs_equal_the_rendered_results():
    text = doc_figures.DOC.read_text(encoding="utf-8")
    results = doc_figures.load_results()
    assert doc_figures.render_doc(text, results) == text, "python -m benchmarks.doc_figures --render --write"
    for name, (_, runs) in doc_figures.BLOCKS.items():
        block = doc_figures.block_pattern(name).search(text).group(2)
        assert {results[r]["date"] for r in runs} <= set(DATE.findall(block)), f"block {name} lacks its date"
    times = doc_figures.block_pattern("algorithm_times").search(text).group(2)
    assert all(f"`{run.command}`" in times for run in doc_figures.RUNS)


def test_a_new_measurement_changes_the_docs():
    results = doc_figures.load_results()
    changed = copy.deepcopy(results)
    # rlhf_e2e's own figures and its PPO step's summary hold the same number
    changed["ppo"]["figures"]["e2e"]["ppo/judge_after"] = 0.123456
    changed["ppo"]["figures"]["final"]["eval/after/judge"] = 0.123456
    changed["ppo"]["date"] = "2031-01-02"
    text = doc_figures.DOC.read_text(encoding="utf-8")
    new = doc_figures.render_doc(text, changed)
    e2e = doc_figures.block_pattern("rlhf_e2e").search(new).group(2)
    assert "→ 0.123**" in e2e and "Measured on 2031-01-02" in e2e
    assert "**0.123**" in doc_figures.block_pattern("algorithms").search(new).group(2)


def test_the_readme_job_is_measured():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert doc_figures.RUNS[0].command in readme
