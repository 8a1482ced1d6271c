"""Nothing measured is lost: each record reaches records.jsonl as it is measured; Ctrl-C and crashes leave the
result files of what was measured, marked partial; `gmtool report` renders them; an output directory that
cannot be written is refused before any model is built."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gmtool.config import SweepConfig
from gmtool.measure.sweep import Sweep
from tests.test_compare import FAST, one_error, run_cli

# largest bucket first: (2, 1*2) then (1, 1*1); two modes each: 4 rows planned
SMALL = [*FAST, "--buckets", "1,2", "--compositions", "1*1,1*2"]


def _stop_at_second_graph_row(monkeypatch, exc: BaseException, out: Path, seen: list):
    """The sweep's second graph replay raises exc, after it notes how many lines the journal holds then."""
    real, calls = Sweep._graph_run, []

    def graph_run(self, *a, **kw):
        calls.append(1)
        if len(calls) == 2:
            seen.append(len((out / "records.jsonl").read_text().splitlines()))
            raise exc
        return real(self, *a, **kw)

    monkeypatch.setattr(Sweep, "_graph_run", graph_run)


def test_ctrl_c_keeps_what_was_measured(tmp_path, monkeypatch):
    out, seen = tmp_path / "run", []
    _stop_at_second_graph_row(monkeypatch, KeyboardInterrupt(), out, seen)
    code, _, err = run_cli("compare", "eager,full", *SMALL, "--out", out)
    assert code == 130 and f"interrupted after 3 of 4 rows; what was measured is in {out}" in " ".join(err.split())
    assert "Traceback" not in err
    assert seen == [1 + 3]  # the journal's header and the 3 rows measured, before anything was finished
    doc = json.loads((out / "results.json").read_text())
    assert doc["partial"] == {"reason": "interrupted", "measured": 3, "planned": 4, "unit": "rows"}
    assert doc["wall_s"] > 0  # it was 0.0: report.md said the run took "0.0 s"
    assert [(r["mode"], r["bucket"]) for r in doc["records"]] == [("eager", 2), ("full", 2), ("eager", 1)]
    assert "partial run: interrupted after 3 of 4 rows" in doc["notes"]
    assert len((out / "results.csv").read_text().splitlines()) == 1 + 3
    assert "partial run: interrupted after 3 of 4 rows" in (out / "report.md").read_text()
    assert (out / "report.html").exists()
    # gmtool report renders it again, and exits as the run did; from the journal alone when results.json never
    # got written, a run that stopped short of its plan (how, the journal does not say): exit 1, never 0
    (out / "report.md").unlink()
    code, stdout, err = run_cli("report", out)
    assert code == 130, err
    assert "interrupted after 3 of 4 rows" in (out / "report.md").read_text()
    (out / "results.json").unlink()
    code, stdout, err = run_cli("report", out)
    assert code == 1 and "records.jsonl" in stdout, err
    md = (out / "report.md").read_text()
    assert "3 of 4 rows measured (read from the journal" in md and "| 2 | full | 1 | ok |" in md


def test_ctrl_c_under_json_prints_the_partial_document(tmp_path, monkeypatch):
    """stdout under --format json holds the command's document, a partial one too: empty, a program reading it
    would get nothing although the run wrote one."""
    out, seen = tmp_path / "run", []
    _stop_at_second_graph_row(monkeypatch, KeyboardInterrupt(), out, seen)
    code, stdout, err = run_cli("compare", "eager,full", *SMALL, "--format", "json", "--out", out)
    assert code == 130 and "interrupted after 3 of 4 rows" in " ".join(err.split())
    doc = json.loads(stdout)
    assert doc == json.loads((out / "results.json").read_text()) and doc["partial"]["measured"] == 3


def test_a_crash_keeps_the_partial_files(tmp_path, monkeypatch):
    from gmtool.app import run_capture

    out, seen = tmp_path / "run", []
    out.mkdir()
    _stop_at_second_graph_row(monkeypatch, RuntimeError("boom"), out, seen)
    cfg = SweepConfig(
        device="cpu", buckets="1,2", compositions="1*1,1*2", modes=("eager", "full"), num_iters=2, num_iters_warmup=0
    )
    with pytest.raises(RuntimeError, match="boom"):
        run_capture(cfg, out)
    doc = json.loads((out / "results.json").read_text())
    assert doc["partial"]["reason"] == "stopped by RuntimeError: boom" and len(doc["records"]) == 3
    assert len((out / "records.jsonl").read_text().splitlines()) == 1 + 3


def test_memreport_interrupted_keeps_finished_strategies(tmp_path, monkeypatch):
    import gmtool.memory.report as report
    from gmtool.app import run_memreport
    from gmtool.errors import Interrupted
    from tests.test_vmm_bookkeeping import MiB, _raw

    def run_strategy(cfg, name, progress=None, shared=None):
        if name == "shared":
            raise KeyboardInterrupt
        return report.derive(_raw(name, 480 * MiB)), None

    monkeypatch.setattr(report, "run_strategy", run_strategy)
    cfg = SweepConfig(device="cpu", buckets="1,2", modes=("eager", "full"))
    with pytest.raises(Interrupted, match="interrupted after 1 of 3 strategies"):
        run_memreport(cfg, ["independent", "shared", "vmm"], tmp_path)
    doc = json.loads((tmp_path / "memreport.json").read_text())
    assert [s["strategy"] for s in doc["strategies"]] == ["independent"]
    assert doc["partial"]["reason"] == "interrupted"


def _unwritable_dir(tmp_path: Path) -> tuple[Path, list[str]]:
    """An existing directory this process cannot create files in (and the options it needs): chmod binds only
    when not root; as root, a directory of /proc (with --force: it is not empty)."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return d, []
    return Path("/proc/self/fd"), ["--force"]


def test_an_unwritable_out_is_refused_before_any_model_is_built(tmp_path, monkeypatch):
    from gmtool.measure.workbench import Workbench

    def no_build(*a, **kw):
        raise AssertionError("a model was built for a run that cannot write its results")

    monkeypatch.setattr(Workbench, "build", no_build)
    ro, extra = _unwritable_dir(tmp_path)
    try:
        code, _, err = run_cli("capture", *SMALL, "--out", ro, *extra)
        assert code == 2 and "cannot write into output directory" in one_error(err), err
        # the default gmtool-out/... under a directory that cannot be written
        monkeypatch.chdir(ro)
        code, _, err = run_cli("capture", *SMALL)
        assert code == 2 and "cannot create output directory gmtool-out" in one_error(err), err
    finally:
        if ro.is_relative_to(tmp_path):
            ro.chmod(0o755)


def test_ctrl_c_in_a_command_without_a_sweep_says_so(tmp_path, monkeypatch):
    """verify (and plan) catch no Ctrl-C themselves: typer turned it into a silent exit 130."""
    import gmtool.verify.run

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(gmtool.verify.run, "run_verify", interrupted)
    code, _, err = run_cli("verify", "--device", "cpu", "--steps", "2", "--check-every", "1", "--out", tmp_path / "v")
    assert code == 130 and err.strip() == "interrupted", err


def test_the_journal_of_a_finished_run_reads_as_finished(tmp_path):
    """`gmtool report DIR/records.jsonl` of a run that measured every row: not "partial ... unfinished after 4 of
    4 rows", nor "the run wrote no results.json" with results.json beside it."""
    out = tmp_path / "run"
    code, _, err = run_cli("compare", "eager,full", *SMALL, "--out", out)
    assert code == 0, err
    code, stdout, err = run_cli("report", out / "records.jsonl", "--format", "json")
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc.get("partial") is None and len(doc["records"]) == 4
    assert "read from the journal (the run's results.json is beside it): all 4 planned rows measured" in doc["notes"]
    assert "partial run" not in (out / "report.md").read_text()


def test_a_tp_run_that_stops_says_its_partial_files_hold_one_rank_s_rows(tmp_path):
    """Under --tp each rank measures every row and rank 0 gathers them at the end: a run stopped before (a rank
    killed) wrote rank 0's rows as if they were the run's."""
    from types import SimpleNamespace

    from gmtool.app import _keeping
    from gmtool.records import Document
    from tests.test_report import make_doc

    written = []
    result = SimpleNamespace(records=[1, 2], document=lambda command: Document.from_dict(make_doc()))
    sweep = SimpleNamespace(result=result, cfg=SimpleNamespace(tp=2))
    with pytest.raises(RuntimeError, match="peer"):
        with _keeping(tmp_path, "compare", 4, sweep, written.append):
            raise RuntimeError("Connection reset by peer")
    assert any(n.startswith("--tp 2: these are this rank's rows only") for n in written[0].notes), written[0].notes


def test_a_tp_journal_never_reads_as_the_whole_run(tmp_path):
    """Under --tp only rank 0 journals, its own rows: a journal holding all of them is still not the run's."""
    from gmtool.report.results import load_results

    out = tmp_path / "run"
    code, _, err = run_cli("compare", "eager,full", *SMALL, "--out", out)
    assert code == 0, err
    lines = (out / "records.jsonl").read_text().splitlines()
    head = json.loads(lines[0])
    head["config"]["tp"] = 2
    (out / "records.jsonl").write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    doc = load_results(out / "records.jsonl")
    assert doc.partial is not None and doc.partial.measured == 4


def test_ctrl_c_while_plan_measures_keeps_what_was_measured(tmp_path, monkeypatch):
    """plan measured into memory and opened its directory only to write the plan: a Ctrl-C lost every row."""
    out, seen = tmp_path / "plan", []
    _stop_at_second_graph_row(monkeypatch, KeyboardInterrupt(), out, seen)
    wl = tmp_path / "w.csv"
    wl.write_text("num_tokens,num_seqs,count\n1,1,10\n2,2,5\n")
    code, _, err = run_cli("plan", "-w", wl, *SMALL, "--out", out)
    assert code == 130 and f"interrupted after 3 of 4 rows; what was measured is in {out}" in " ".join(err.split())
    doc = json.loads((out / "results.json").read_text())
    assert doc["partial"]["measured"] == 3 and len(doc["records"]) == 3
    assert not (out / "plan.json").exists()
    code, _, err = run_cli("plan", "-w", wl, "--from", out, "--out", tmp_path / "p2")  # and plans from them
    assert code == 0, err


def test_ctrl_c_in_verify_keeps_the_soaks_that_finished(tmp_path, monkeypatch):
    """verify lost everything on Ctrl-C: no verify.json, though its analyses and a soak had finished."""
    from gmtool.verify.soak import Soak

    real, calls = Soak.run, []

    def run(self):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Soak, "run", run)
    out = tmp_path / "v"
    code, stdout, err = run_cli(
        "verify", "--device", "cpu", "--modes", "full,piecewise", "--steps", "6", "--check-every", "3", "--out", out
    )
    assert code == 130 and f"what was measured is in {out}" in " ".join(err.split()), err
    doc = json.loads((out / "verify.json").read_text())
    assert doc["partial"] == {"reason": "interrupted", "measured": 1, "planned": 2, "unit": "soaks"}
    assert [r["mode"] for r in doc["runs"]] == ["full"] and doc["exit_code"] == 130
    assert doc["verdict"].startswith("verify: interrupted after 1 of 2 soaks: 6 steps") and doc["dynamic_dims"]
