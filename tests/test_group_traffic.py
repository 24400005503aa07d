"""The least memory traffic of each generated kernel group (``agent.builtin.group_traffic``), which
``scripts/kernel_bandwidth.py`` divides by a profile's kernel times: every input read once and the
output written once, at the task's sizes, for the header a stored candidate carries."""
from __future__ import annotations

from pathlib import Path

from agent.builtin import generate, group_traffic
from agent.builtin.codegen import Knobs
from sandbox.tasks import read_spec

CONV_POOL = Path(__file__).parent / "fixtures" / "builtin" / "conv_pool.py"
F32 = 4


def test_a_pool_groups_traffic_is_its_inputs_and_output_once():
    # conv_pool.py: x (2, 3, 15, 17); conv 3x3 -> (2, 8, 13, 15); max pool 2 -> (2, 8, 6, 7)
    spec = read_spec(CONV_POOL, name="fixtures/conv_pool")
    conv_out, pooled, bias = 2 * 8 * 13 * 15, 2 * 8 * 6 * 7, 8
    for device, knobs, reads in (("cuda", Knobs(layout="nchw"), conv_out + bias),   # the conv's bias split off
                                 ("cpu", Knobs(layout="nchw"), conv_out)):          # the library conv keeps it
        cand = generate(spec, device, knobs)
        traffic = group_traffic(spec, device, cand.choices)
        names = [g["name"] for g in cand.choices["groups"]]
        assert sorted(traffic) == sorted(names)
        first = traffic[names[0]]
        assert first["kind"] == "pool" and "max_pool2d" in first["ops"]
        assert first["bytes"] == (reads + pooled) * F32, (device, first)


def test_the_header_decides_the_groups_measured():
    spec = read_spec(CONV_POOL, name="fixtures/conv_pool")
    fused = generate(spec, "cpu", Knobs(layout="nchw"))
    apart = generate(spec, "cpu", Knobs(layout="nchw", fusion="elementwise"))      # the library's pooling
    assert {g["kind"] for g in group_traffic(spec, "cpu", fused.choices).values()} == {"pool"}
    assert "pool" not in {g["kind"] for g in group_traffic(spec, "cpu", apart.choices).values()}
