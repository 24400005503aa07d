"""``kernelloop device``: measure and show the device's bandwidth and FLOP ceilings
(``hardware.probe`` measures them; ``store.probes`` keeps them)."""
from __future__ import annotations

from typing import Optional

import typer

from hardware.probe import Probe, cache_file, device_name, torch_version
from kernelloop.cli_common import DbOption, DeviceOption, console, fail, open_store, resolve_device
from store.probes import all_probes, get_probe, load_cached

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Measure and show the device's bandwidth and FLOP ceilings.")


@app.callback()
def _group(db: Optional[str] = DbOption) -> None:
    """``--db`` here holds for every device subcommand."""


# --------------------------------------------------------------------------- commands

def _print_probe(probe: Probe, title: str) -> None:
    from rich.table import Table

    table = Table(title=title, show_header=True)
    table.add_column("ceiling")
    table.add_column("value", justify="right")
    table.add_row("device", f"{probe.device}: {probe.device_name}")
    table.add_row("torch", probe.torch_version)
    table.add_row("bandwidth", f"{probe.bandwidth_gbps:,.1f} GB/s")
    for label, rate in sorted(probe.tflops.items()):
        table.add_row(f"matmul {label}", f"{rate:,.2f} TFLOP/s")
    if probe.created_at:
        table.add_row("measured", probe.created_at)
    console.print(table)


@app.command("probe")
def probe_command(device: Optional[str] = DeviceOption, db: Optional[str] = DbOption) -> None:
    """Measure bandwidth and matmul FLOP rates now and cache them (store and cache file)."""
    dev = resolve_device(device)
    store = open_store(db)
    try:
        probe = get_probe(dev, store, measure=True, refresh=True)
    finally:
        store.close()
    _print_probe(probe, "device probe (measured now)")
    console.print(f"cached in the store and in {cache_file()}")


@app.command("show")
def show_command(device: Optional[str] = DeviceOption, db: Optional[str] = DbOption,
                 all_: bool = typer.Option(False, "--all", help="list every probe in the store")) -> None:
    """Show the cached ceilings of this device (and torch version); nothing is measured."""
    dev = resolve_device(device)
    store = open_store(db)
    try:
        if all_:
            _show_all(store)
            return
        probe = load_cached(dev, store)
    finally:
        store.close()
    if probe is None:
        fail(f"no probe cached for {device_name(dev)} with torch {torch_version()}; "
             f"run: kernelloop device probe --device {dev}", code=1)
    _print_probe(probe, "device probe (cached)")


def _show_all(store) -> None:
    from rich.table import Table

    table = Table(title="device probes in the store")
    for col in ("device", "device name", "torch", "GB/s", "TFLOP/s", "measured"):
        table.add_column(col)
    for p in all_probes(store):
        rates = ", ".join(f"{k} {v:.1f}" for k, v in sorted(p.tflops.items()))
        table.add_row(p.device, p.device_name, p.torch_version, f"{p.bandwidth_gbps:,.1f}", rates, p.created_at or "")
    console.print(table)
