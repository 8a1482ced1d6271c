"""Sweep profiles (--profile): the command line beats the profile, the profile beats SweepConfig's defaults."""

import json
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from gmtool.cli.main import app
from gmtool.cli.run_sweep import build_config
from gmtool.config import SweepConfig
from gmtool.errors import GmtoolError
from gmtool.profiles import load_sweep_profile, sweep_profiles

runner = CliRunner()
PREFILL = {"scenario": "prefill", "buckets": "16", "block_size": 8}
QUICK = ["--device", "cpu", "--num-iters", "2", "--num-iters-warmup", "1"]


def write_profile(tmp_path, prof, name="prof.json"):
    path = tmp_path / name
    path.write_text(json.dumps(prof))
    return str(path)


def capture(tmp_path, *args):
    out = tmp_path / "run"
    r = runner.invoke(app, ["capture", *QUICK, "--out", str(out), *args])
    assert r.exit_code == 0, (r.output, r.exception)
    return json.loads((out / "results.json").read_text())["config"]


def test_profile_beats_defaults(tmp_path):
    cfg = capture(tmp_path, "--profile", write_profile(tmp_path, PREFILL))
    assert cfg["scenario"] == "prefill" and cfg["block_size"] == 8 and cfg["bucket_sizes"] == [16]


def test_command_line_beats_profile(tmp_path):
    cfg = capture(tmp_path, "--profile", write_profile(tmp_path, PREFILL), "--block-size", "32", "--scenario", "mixed")
    assert cfg["block_size"] == 32 and cfg["scenario"] == "mixed" and cfg["bucket_sizes"] == [16]


def test_defaults_hold_without_a_profile(tmp_path):
    cfg = capture(tmp_path, "--buckets", "1,2")
    defaults = SweepConfig.__dataclass_fields__
    assert cfg["block_size"] == 16 == defaults["block_size"].default
    assert cfg["scenario"] == "decode" == defaults["scenario"].default
    assert cfg["max_num_seqs"] == defaults["max_num_seqs"].default and cfg["seed"] == defaults["seed"].default
    assert cfg["fuse"] is False and cfg["compile"] is False and cfg["modes"] == ["eager", "full"]


def test_builtin_prefill_profile_runs_prefill(tmp_path):
    # the profile's own buckets go up to 2048: the command line narrows them (and its compositions) to stay quick
    cfg = capture(tmp_path, "--profile", "prefill-default", "--buckets", "16", "--compositions", "8+8,4*4")
    assert cfg["scenario"] == "prefill" and cfg["bucket_sizes"] == [16]
    assert cfg["compositions_by_bucket"] == {"16": ["8+8", "4*4"]}


def test_builtin_prefill_profile_config():
    cfg = build_config("prefill-default", device="cpu")
    assert cfg.scenario == "prefill" and cfg.bucket_sizes == [128, 512, 2048]


def test_boolean_and_iterations_from_profile(tmp_path):
    prof = write_profile(tmp_path, {**PREFILL, "fuse": True, "num_iters": 3})
    cfg = capture(tmp_path, "--profile", prof, "--num-iters", "2")
    assert cfg["fuse"] is True and cfg["num_iters"] == 2  # the profile's fuse holds; --num-iters beats it
    cfg = build_config(prof, device="cpu")
    assert cfg.num_iters == 3 and cfg.fuse is True
    cfg = build_config(prof, device="cpu", fuse=False)  # --no-fuse beats the profile
    assert cfg.fuse is False


def test_profile_modes_reach_capture(tmp_path):
    prof = write_profile(tmp_path, {**PREFILL, "modes": ["eager", "piecewise"]})
    assert capture(tmp_path, "--profile", prof)["modes"] == ["eager", "piecewise"]
    assert build_config(prof, device="cpu", modes=("eager", "full")).modes == ("eager", "full")


def test_unknown_profile_key_is_one_line_error(tmp_path):
    prof = write_profile(tmp_path, {**PREFILL, "blocksize": 8})
    p = subprocess.run(
        [sys.executable, "-m", "gmtool.cli.main", "capture", *QUICK, "--profile", prof, "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr
    assert "'blocksize'" in p.stderr and "Traceback" not in p.stderr + p.stdout
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "prof,msg",
    [
        ({"blocksize": 8}, "'blocksize'"),
        ({"block_size": "8"}, "block_size"),
        ({"fuse": "yes"}, "fuse"),
        ({"num_iters": True}, "num_iters"),
        ({"modes": "eager"}, "modes"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_profile_is_refused(tmp_path, prof, msg):
    path = write_profile(tmp_path, prof)
    with pytest.raises(GmtoolError, match=msg):
        load_sweep_profile(path)


def test_a_profile_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_bytes(b'{"buckets": "1,2", "description": "\xff\xfe"}')
    with pytest.raises(GmtoolError, match="is not UTF-8 text"):
        load_sweep_profile(str(path))


@pytest.mark.parametrize("name", sweep_profiles())
def test_builtin_profiles_have_known_keys(name):
    assert load_sweep_profile(name)  # raises on an unknown key or a wrong type


def test_compare_and_memreport_take_the_profile(tmp_path, monkeypatch):
    """compare and memreport go through build_config too: their unset options must not mask the profile."""
    import gmtool.cli.compare as cmp
    import gmtool.cli.memreport as mem

    seen = []

    def stop(profile, **opts):
        seen.append(build_config(profile, **opts))
        raise GmtoolError("stop")

    monkeypatch.setattr(cmp, "build_config", stop)
    monkeypatch.setattr(mem, "build_config", stop)
    prof = write_profile(tmp_path, {**PREFILL, "modes": ["eager", "piecewise"]})
    for cmd in (["compare"], ["compare", "eager,full"], ["memreport"], ["memreport", "--mode", "full"]):
        r = runner.invoke(app, [*cmd, "--device", "cpu", "--profile", prof, "--out", str(tmp_path / "y")])
        assert isinstance(r.exception, GmtoolError) and str(r.exception) == "stop", r.output
    assert [(c.scenario, c.block_size) for c in seen] == [("prefill", 8)] * 4
    assert [c.modes for c in seen] == [("eager", "piecewise"), ("eager", "full")] * 2


def test_memreport_refuses_profile_with_several_graph_modes(tmp_path):
    prof = write_profile(tmp_path, {"modes": ["eager", "full", "piecewise"]})
    r = runner.invoke(app, ["memreport", "--device", "cpu", "--profile", prof, "--out", str(tmp_path / "y")])
    assert isinstance(r.exception, GmtoolError) and "one graph mode" in str(r.exception)


def test_help_shows_the_config_defaults():
    r = runner.invoke(app, ["capture", "--help"], terminal_width=300, env={"COLUMNS": "300"})
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    for default in (
        "[default: (decode)]",
        "[default: (16)]",
        "[default: (256)]",
        "[default: (20)]",
        "[default: (auto)]",
        "[default: (breakable)]",
        "[default: (no-fuse)]",
        "[default: (full)]",
    ):
        assert default in text, default


def test_a_key_given_twice_in_a_sweep_profile_is_refused(tmp_path):
    """json keeps the last of two values of a key: the first would be dropped without a word."""
    from gmtool.errors import GmtoolError
    from gmtool.profiles import load_sweep_profile

    p = tmp_path / "dup.json"
    p.write_text('{"buckets": "1", "scenario": "decode", "buckets": "2"}')
    with pytest.raises(GmtoolError, match="gives 'buckets' twice: keep one"):
        load_sweep_profile(str(p))


def test_a_refusal_of_a_profile_s_value_says_it_came_from_the_profile(tmp_path):
    """The refusal named the command-line flag (--max-tokens 4 ...) the user never gave."""
    from gmtool.cli.run_sweep import build_config
    from gmtool.errors import GmtoolError

    p = tmp_path / "q.json"
    p.write_text(json.dumps({"buckets": "1,2,4,8", "max_tokens": 4}))
    with pytest.raises(
        GmtoolError,
        match=rf"lower --buckets \(max_tokens: 4, buckets: '1,2,4,8' came from sweep profile {re.escape(str(p))}\)$",
    ):
        build_config(str(p), device="cpu")
    with pytest.raises(
        GmtoolError, match=rf"lower --buckets \(buckets: '1,2,4,8' came from sweep profile {re.escape(str(p))}\)$"
    ):
        build_config(str(p), device="cpu", max_tokens=4)
    with pytest.raises(GmtoolError, match=r"lower --buckets$"):  # all of it from the command line
        build_config(None, device="cpu", buckets="1,2,4,8", max_tokens=4)
