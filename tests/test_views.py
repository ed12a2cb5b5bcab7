"""The views of one simulated step through the library and the CLI: a small real model (resnet18 at 64x64)
simulated, its step as a timeline, a plot and a CUDA memory snapshot that torch's own tools read."""

from __future__ import annotations

import json
import pickle

import pytest

import estimator
from estimator import parse_request
from estimator.cli.main import main
from estimator.pipeline import estimate, step_view
from estimator.replay.snapshot import snapshot_of
from estimator.simulate.source import Simulator

pytestmark = pytest.mark.sim

RESNET = {"model": {"source": "torchvision", "name": "resnet18"}, "input": {"image_size": [3, 64, 64]},
          "gpus": ["A100-80GB"], "planner": {"confirm": "none", "curve_points": 0}}


def _peaks(snapshot: dict) -> tuple[int, int]:
    """(allocated, reserved) peaks added up from the device trace alone, as the viewer adds them."""
    allocated = reserved = top_allocated = top_reserved = 0
    for e in snapshot["device_traces"][0]:
        sign = {"alloc": 1, "free_completed": -1, "segment_alloc": 1, "segment_free": -1}.get(e["action"], 0)
        if e["action"] in ("alloc", "free_completed"):
            allocated += sign * e["size"]
            top_allocated = max(top_allocated, allocated)
        elif e["action"].startswith("segment"):
            reserved += sign * e["size"]
            top_reserved = max(top_reserved, reserved)
    return top_allocated, top_reserved


def _replayed(snapshot: dict) -> tuple[dict[int, int], dict[int, int]]:
    """The segments and live blocks (address -> bytes) after the whole device trace, played from nothing."""
    segments: dict[int, int] = {}
    blocks: dict[int, int] = {}
    for e in snapshot["device_traces"][0]:
        if e["action"] == "segment_alloc":
            segments[e["addr"]] = e["size"]
        elif e["action"] == "segment_free":
            del segments[e["addr"]]
        elif e["action"] == "alloc":
            blocks[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            del blocks[e["addr"]]
    return segments, blocks


def test_the_snapshot_of_a_real_step_adds_up_to_its_report_and_torch_reads_it() -> None:
    from torch.cuda import _memory_viz

    request = parse_request(RESNET)
    view = step_view(request)  # no batch named: the card's recommended batch
    answer = estimate(request).results[0]
    assert view.batch_size == answer.recommended_batch_size
    at = estimate(parse_request({**RESNET, "batch_size": view.batch_size})).results[0].memory
    assert (view.report.allocated_peak_bytes, view.report.reserved_peak_bytes, view.report.device_peak_bytes) == (
        at.allocated_peak_bytes, at.reserved_peak_bytes, at.device_peak_bytes)  # the planner's numbers
    snap = snapshot_of(view)
    assert _peaks(snap) == (view.report.allocated_peak_bytes, view.report.reserved_peak_bytes)
    # the final state the viewer starts from is where the trace ends (it plays the trace backwards from it)
    segments, blocks = _replayed(snap)
    assert segments == {s["address"]: s["total_size"] for s in snap["segments"]}
    assert blocks == {b["address"]: b["size"] for s in snap["segments"] for b in s["blocks"]
                      if b["state"] == "active_allocated"}
    for html in (_memory_viz.trace_plot(snap), _memory_viz.segment_plot(snap)):
        assert html.startswith("\n<!DOCTYPE html>") and "snapshot.pickle" in html
    summary = _memory_viz.segsum(snap)  # checks that each segment's blocks add up to it
    assert f"segments: {len(snap['segments'])}" in summary
    text = _memory_viz.trace(snap)
    assert text.startswith(f"Device 0 ----------------\n{len(snap['device_traces'][0])} entries\n")
    assert pickle.loads(pickle.dumps(snap)) == snap


def test_the_timeline_of_a_real_step() -> None:
    t = estimator.timeline(parse_request(RESNET), 16)
    assert (t.gpu, t.batch_size, t.events) == ("A100-80GB", 16, len(t.points))  # fewer than 2000 events: all
    assert t.allocated[t.peak_event] == t.allocated_peak_bytes == max(t.allocated)
    assert max(t.reserved) == t.reserved_peak_bytes and t.device_peak_bytes > t.reserved_peak_bytes
    # the peak's phase is the span it falls in (at batch 16 the optimizer's step, at the recommended the backward)
    assert t.peak_phase == [p.phase for p in t.phases if p.start <= t.peak_event][-1]
    assert [p.phase for p in t.phases][:6] == ["setup", "input", "forward", "loss", "backward", "optimizer"]
    assert {p.iteration for p in t.phases} == {0, 1}
    assert t.categories["parameter"][-1] == 4 * 11_689_512  # resnet18's 11,689,512 fp32 parameters, as requested


def test_the_view_reuses_the_step_the_search_simulated(monkeypatch) -> None:
    # 16 MiB usable (450 MiB of CUDA context and the 256 MiB reserve besides), less than resnet18's 45 MiB of
    # parameters: nothing fits, the view is at the smallest batch, 1, which the search simulated already
    tiny = {**RESNET, "gpus": [{"name": "tiny", "memory_bytes": (450 + 256 + 16) * 2**20, "compute_capability": "8.0"}]}
    calls: list[int] = []
    simulate = Simulator.simulate

    def counted(self, batch, gpu):
        calls.append(batch)
        return simulate(self, batch, gpu)

    monkeypatch.setattr(Simulator, "simulate", counted)
    request = parse_request({**tiny, "planner": {**tiny["planner"], "suggestions": False}})
    estimate(request)
    searched = list(calls)
    calls.clear()
    view = step_view(request)
    assert calls == searched and 1 in searched  # no simulation beyond the search's
    assert view.batch_size == 1 and not view.report.fits


def test_cli_writes_the_plot_and_the_snapshot(tmp_path, capsys) -> None:
    spec = tmp_path / "req.json"
    spec.write_text(json.dumps({**RESNET, "batch_size": 32}))
    png, pkl = tmp_path / "step.png", tmp_path / "step.pickle"
    assert main(["estimate", "--spec", str(spec), "--plot", str(png), "--snapshot", str(pkl)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [f"wrote {png}", f"wrote {pkl} (open it at https://pytorch.org/memory_viz)"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    snap = pickle.loads(pkl.read_bytes())
    assert set(snap) == {"segments", "device_traces"} and snap["device_traces"][0][0]["action"] == "segment_alloc"


def test_cli_json_keeps_stdout_to_the_response_and_a_profile_snapshot_adds_up(tmp_path, capsys) -> None:
    spec = tmp_path / "req.json"
    spec.write_text(json.dumps(RESNET))
    assert main(["profile", "--spec", str(spec), "-o", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    pkl = tmp_path / "step.pickle"
    code = main(["estimate", "--profile", str(tmp_path / "p.json"), "--gpus", "A100-80GB", "--batch-size", "24",
                 "--json", "--snapshot", str(pkl)])
    out, err = capsys.readouterr()
    assert code == 0, err
    memory = json.loads(out)["results"][0]["memory"]  # stdout is the response alone
    assert f"wrote {pkl} (open it at https://pytorch.org/memory_viz)" in err
    # the profile's step at batch 24, synthesized, adds up to the response's memory there
    assert memory["batch_size"] == 24
    assert _peaks(pickle.loads(pkl.read_bytes())) == (memory["allocated_peak_bytes"], memory["reserved_peak_bytes"])


def test_cli_a_snapshot_that_cannot_be_written_is_exit_2(tmp_path, capsys) -> None:
    spec = tmp_path / "req.json"
    spec.write_text(json.dumps({**RESNET, "batch_size": 4}))
    where = tmp_path / "missing" / "step.pickle"
    assert main(["estimate", "--spec", str(spec), "--snapshot", str(where)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --snapshot: got '{where}'; expected a file that can be written")
