"""Output people read: tables that fit 80 columns (columns dropped by priority, never a number cut to '0.…'), a
legend and a verdict line, the noise marks in capture as in compare, one progress line per bucket when stdout is
not a terminal, one colour per mode in every plot, and --format human|json|quiet on every command."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from gmtool.cli.progress import LineProgress, SweepProgress, progress_bars
from gmtool.report.fitted import Column, FittedTable
from gmtool.report.plots import MODE_COLOURS, all_figures
from gmtool.report.results import output_dir
from gmtool.report.summary import verdict
from gmtool.report.tables import capture_table, compare_table
from tests.test_compare import FAST, run_cli
from tests.test_report import make_doc, timing


def test_a_failed_default_run_leaves_no_gmtool_out_behind(tmp_path, monkeypatch):
    """The default --out is gmtool-out/<command>-...: a run that fails first leaves neither directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError):
        with output_dir(tmp_path / "gmtool-out" / "capture-1", force=False):
            raise RuntimeError("refused before writing")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "gmtool-out").mkdir()
    (tmp_path / "gmtool-out" / "older-run").mkdir()
    with pytest.raises(RuntimeError):
        with output_dir(tmp_path / "gmtool-out" / "capture-2", force=False):
            raise RuntimeError("refused before writing")
    assert [p.name for p in (tmp_path / "gmtool-out").iterdir()] == ["older-run"]  # not created by this run


# -- tables at 80 columns --------------------------------------------------------------------------------------
def _with_host_times(doc: dict) -> dict:
    for r in doc["records"]:
        if r["mode"] != "eager":
            r.update(host_us=timing(123.0), host_steady_us=timing(45.0))
    return doc


def render(table, width: int) -> str:
    console = Console(file=io.StringIO(), width=width)
    console.print(table)
    return console.file.getvalue()


@pytest.mark.parametrize("width", [80, 100, 250])
def test_capture_and_compare_tables_fit_and_never_cut_a_number(width):
    doc = _with_host_times(make_doc())
    for table in (capture_table(doc), compare_table(doc)):
        text = render(table, width)
        assert max(len(ln) for ln in text.splitlines()) <= width
        assert "…" not in text
        # the important figures are whole at any width: replay (with its noise mark), speedup, error, status
        for needle in ("1.050", "2.100!", "3.90x", "1.50e+00", "UNSAFE", "full-narrow", "hf-compiled"):
            assert needle in text, (needle, text)
    wide = render(capture_table(doc), 250)
    assert "123/45" in wide and "not shown" not in wide
    assert "mixes: batch compositions replayed per bucket" in wide
    assert "pieces/runners: captured graph pieces / attention calls run between them" in wide


def test_narrow_tables_say_which_columns_they_left_out():
    doc = _with_host_times(make_doc())
    text = " ".join(render(capture_table(doc), 80).split())
    left_out = text.split("not shown at 80 columns: ", 1)[1].split(" (")[0].split(", ")
    # pieces/runners is empty in this document: the first to go; then the least important
    assert {"pieces/runners", "host us idle/steady", "mixes"} <= set(left_out)
    assert "replay ms" not in left_out and "speedup" not in left_out


def test_rank_zero_columns_stay_whatever_the_width():
    t = FittedTable(
        "t",
        [Column("mode", justify="left"), Column("a", rank=1), Column("status", justify="left")],
        [["piecewise", "12345678", "UNSAFE"]],
    )
    assert t.shown(10) == [0, 2] and t.shown(80) == [0, 1, 2]


def test_memreport_table_fits_80_columns():
    from gmtool.config import SweepConfig
    from gmtool.memory.report import build_document, derive, memreport_table, memreport_verdict
    from tests.test_vmm_bookkeeping import MiB, _raw

    cfg = SweepConfig(device="cpu", buckets="1,2,4,8", modes=("eager", "full"))
    doc = build_document(
        cfg,
        [
            derive(_raw("independent", 480 * MiB)),
            derive(_raw("shared", 272 * MiB)),
            derive({"strategy": "vmm", "mode": "full", "status": "unavailable", "reason": "x"}),
        ],
    )
    text = render(memreport_table(doc), 80)
    assert max(len(ln) for ln in text.splitlines()) <= 80 and "…" not in text
    assert "1.06" in text and "4/4" in text and "unavailable" in text
    assert memreport_verdict(doc) == "2 ok, 0 UNSAFE, 0 errors (3 strategies; 1 unavailable here)"


def test_verdict_counts_the_replays_checked_against_eager():
    doc = make_doc()
    assert verdict(doc) == (
        "7 ok, 2 UNSAFE, 1 errors (9 replays checked against eager; 1 UNSAFE of full-narrow, as expected)"
    )  # the error row's capture failed: no replay of it was checked
    doc["partial"] = {"reason": "interrupted", "measured": 12, "planned": 20, "unit": "rows"}
    assert verdict(doc).endswith("; partial run: interrupted after 12 of 20 rows)")
    # eager rows whose batch could not be built are errors, and no replay was checked for them
    failed = [dict(r, status="error", error="KV cache full") for r in make_doc()["records"] if r["mode"] == "eager"]
    assert failed and verdict({**make_doc(), "records": failed}).startswith(
        f"0 ok, 0 UNSAFE, {len(failed)} errors (0 replays checked against eager"
    )


# -- progress --------------------------------------------------------------------------------------------------
def test_progress_when_not_a_terminal_is_one_line_per_bucket_with_an_eta():
    now = [0.0]
    console = Console(file=io.StringIO(), width=200)
    p = LineProgress(console, "capture", clock=lambda: now[0])
    p.start(5)
    for t, label in (
        (10, "bucket 4: 1*4"),
        (20, "bucket 4: 2*2"),
        (30, "bucket 2: 1*2"),
        (40, "bucket 2: 2*1"),
        (50, "bucket 1: 1*1"),
    ):
        now[0] = t
        p.advance(label)
    assert console.file.getvalue().splitlines() == [
        "capture: bucket 4 done, 2/5 rows, 0:30 elapsed, ETA 0:45",  # the line comes when bucket 2 starts
        "capture: bucket 2 done, 4/5 rows, 0:50 elapsed, ETA 0:12",
        "capture: bucket 1 done, 5/5 rows, 0:50 elapsed, done",
    ]
    assert isinstance(progress_bars(Console(file=io.StringIO()))("x"), LineProgress)
    assert isinstance(progress_bars(Console(file=io.StringIO(), force_terminal=True))("x"), SweepProgress)


def test_compare_progress_counts_the_rows_it_writes(tmp_path):
    """compare's progress said '10/10 rows' for a run of 30 rows (it counted compositions, not one row a mode),
    while a Ctrl-C in it said 'interrupted after 8 of 30 rows'."""
    code, stdout, _ = run_cli("compare", "eager,full,piecewise", *FAST, "--buckets", "2", "--out", tmp_path / "o")
    rows = json.loads((tmp_path / "o" / "results.json").read_text())["records"]
    assert code == 0 and len(rows) == 9, stdout
    assert "compare: bucket 2 done, 9/9 rows" in stdout, stdout


# -- plots -----------------------------------------------------------------------------------------------------
def test_a_mode_has_one_colour_in_every_plot():
    doc = make_doc()
    colours: dict[str, set] = {}
    for _, fig in all_figures(doc):
        if fig is None:  # nothing measured for it (this document has no floors)
            continue
        for line in fig.axes[0].get_lines():
            if not line.get_label().startswith("_"):  # the 1.0 reference line has no label
                colours.setdefault(line.get_label(), set()).add(line.get_color())
    assert set(colours) >= {"eager", "full", "piecewise", "hf-compiled"}
    assert all(len(c) == 1 for c in colours.values()), colours
    assert len({next(iter(c)) for c in colours.values()}) == len(colours)  # and no two modes share one
    assert {m: MODE_COLOURS[m] for m in colours} == {m: next(iter(c)) for m, c in colours.items()}


def test_bucket_labels_never_crowd_and_autos_eager_sizes_are_marked():
    """auto's eager sizes sit just above the largest bucket: 512 and 520 were labelled on top of each other, and
    nothing told the eager points from the graphs'."""
    from gmtool.report.plots import latency_figure, ticks
    from tests.test_report import rec

    engines = [1, 2, 4, *range(8, 513, 8)]
    got = ticks([*engines, 520], log=True)
    assert got[-1] == 520 and 512 not in got and {1, 2, 4, 64, 256} <= set(got), got
    span = math.log2(520)
    assert all(math.log2(b) - math.log2(a) >= span / 14 for a, b in zip(got, got[1:])), got
    assert ticks([16, 32, 33, 40], log=False) == [16, 33, 40]  # 32 is 1/24 of the axis from 33
    assert ticks([16, 32, 34, 40], log=False) == [16, 32, 34, 40]  # 1/12: room for both
    assert ticks([1, 2, 4, 8], log=True) == [1, 2, 4, 8]

    doc = make_doc()
    doc["records"] += [rec("eager", 40, "40", ms=12.0, eager=12.0), rec("auto", 40, "40", ms=12.1, eager=12.0)]
    doc["config"]["eager_sizes"] = [40]
    labels = [line.get_label() for line in latency_figure(doc).axes[0].get_lines()]
    assert "auto: eager above 16" in labels, labels
    doc["config"]["eager_sizes"] = []
    assert not any("eager above" in x for x in (line.get_label() for line in latency_figure(doc).axes[0].get_lines()))


# -- --format on every command ---------------------------------------------------------------------------------
CAPTURE = ["capture", *FAST, "--buckets", "1", "--compositions", "1*1"]


def noisy_ms(fn, iters, warmup, device):
    """time_ms with a stub clock whose samples spread far more than 10% of their median."""
    for _ in range(warmup + iters):
        fn()
    return [1.0, 1.0, 3.0, 3.0][:iters] if iters >= 4 else [1.0, 3.0][:iters]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """One capture run in json format: stdout is the document, and nothing else."""
    out = tmp_path_factory.mktemp("fmt") / "cap"
    code, stdout, stderr = run_cli(*CAPTURE, "--format", "json", "--out", out)
    return code, stdout, stderr, out


def test_capture_json_prints_only_the_document(captured):
    code, stdout, stderr, out = captured
    assert code == 0, stderr
    assert json.loads(stdout) == json.loads((out / "results.json").read_text())
    assert "rows" in stderr  # progress went to stderr, one line per bucket


def test_capture_quiet_prints_the_verdict_alone(tmp_path):
    code, stdout, stderr = run_cli(*CAPTURE, "--format", "quiet", "--out", tmp_path / "q")
    assert code == 0, stderr
    assert stdout.splitlines() == ["verdict: 1 ok, 0 UNSAFE, 0 errors (1 replays checked against eager)"]
    assert stderr == ""


def test_capture_human_shows_noise_marks_legend_and_verdict(tmp_path, monkeypatch):
    import gmtool.measure.sweep

    monkeypatch.setattr(gmtool.measure.sweep, "time_ms", noisy_ms)
    code, stdout, stderr = run_cli(
        "capture",
        "--device",
        "cpu",
        "--num-iters",
        "4",
        "--buckets",
        "1",
        "--compositions",
        "1*1",
        "--out",
        tmp_path / "h",
    )
    assert code == 0, stderr
    text = " ".join(stdout.split())
    assert "2.000!" in stdout  # the replay median, marked noisy as compare marks it
    assert "warning: 2 of 2 timings are noisy" in text
    assert "mixes: batch compositions replayed per bucket" in text
    # not a terminal: a line per bucket, counting rows as results.json holds them (the eager row and full's)
    assert "capture: bucket 1 done, 2/2 rows" in stdout
    assert "graph memory ledger" in text  # capture shows the ledger of its captured buckets, as compare does
    assert stdout.rstrip().splitlines()[-1] == "verdict: 1 ok, 0 UNSAFE, 0 errors (1 replays checked against eager)"


@pytest.mark.parametrize("fmt", ["json", "quiet"])
def test_report_and_plan_formats(captured, tmp_path, fmt):
    out = captured[3]
    code, stdout, stderr = run_cli("report", out, "--format", fmt)
    assert code == 0, stderr
    if fmt == "json":
        assert json.loads(stdout)["records"] == json.loads((out / "results.json").read_text())["records"]
    else:
        assert stdout.splitlines() == ["verdict: 1 ok, 0 UNSAFE, 0 errors (1 replays checked against eager)"]
    wl = tmp_path / "w.csv"
    wl.write_text("num_tokens,num_seqs,count\n1,1,10\n")
    code, stdout, stderr = run_cli("plan", "--workload", wl, "--from", out, "--out", tmp_path / "p", "--format", fmt)
    assert code == 0, stderr
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    if fmt == "json":
        assert json.loads(stdout) == plan
    else:
        assert stdout.splitlines() == [
            f"capture sizes: {','.join(map(str, plan['capture_sizes'])) or '(none: no set of candidate sizes within the budgets beats running eager)'}"
        ]


def test_verify_json(tmp_path):
    code, stdout, stderr = run_cli(
        "verify",
        "--device",
        "cpu",
        "--modes",
        "full",
        "--steps",
        "2",
        "--check-every",
        "1",
        "--format",
        "json",
        "--out",
        tmp_path / "v",
    )
    assert code == 0, stderr
    assert json.loads(stdout) == json.loads((tmp_path / "v" / "verify.json").read_text())


@pytest.mark.parametrize("command", ["capture", "compare", "memreport", "report", "plan", "verify"])
def test_every_command_takes_format(command):
    code, stdout, _ = run_cli(command, "--help")
    assert code == 0 and "--format" in stdout and "human" in stdout and "quiet" in stdout


def test_verdicts_and_notes_print_brackets_as_written(capsys):
    from gmtool.cli.output import Output

    out = Output("human")
    out.note("layer [0] was left alone")
    out.verdict("verify: WRONG REPLAY FOUND (1): bucket [d8] differs", False, label="")
    said = capsys.readouterr().out
    assert "note: layer [0] was left alone" in said and "bucket [d8] differs" in said
    Output("quiet").verdict("1 ok, 0 UNSAFE, 0 errors", True)
    assert capsys.readouterr().out == "verdict: 1 ok, 0 UNSAFE, 0 errors\n"
