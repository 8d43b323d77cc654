"""Every script in examples/ runs, and the overhead benchmark's quick mode reports its lines."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, (
        f"{' '.join(args)} exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
    return result


def _check_quickstart(stdout: str, stderr: str = "") -> None:
    # The plain round gives the first layer no gradient at all; the override gives it one,
    # and the network then fits better than with the last layer alone learning.
    rows = {}
    for name in ("plain torch.round", "go.custom_backward"):
        match = re.search(rf"^{re.escape(name)}\s+([-0-9.]+)\s+([-0-9.]+)\s+([-0-9.]+)$",
                          stdout, re.M)
        assert match, f"no row for {name!r} in:\n{stdout}"
        rows[name] = [float(v) for v in match.groups()]
    assert stderr == "", f"the quickstart printed to stderr (a warning?):\n{stderr}"
    plain, override = rows["plain torch.round"], rows["go.custom_backward"]
    assert plain[0] == 0.0, stdout
    assert override[0] > 0.1, stdout
    assert override[2] < override[1] and override[2] < plain[2], stdout
    # The getting-started page shows this output: it must be what the script prints.
    page = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert f"```text\n{stdout.strip()}\n```" in page, (
        f"docs/getting-started.md does not show what examples/quickstart.py prints:\n{stdout}"
    )


def test_there_are_examples() -> None:
    assert any(p.name == "quickstart.py" for p in EXAMPLES)


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script: Path, tmp_path: Path) -> None:
    args: list[str] = []
    if script.name == "plot_surrogates.py":
        if importlib.util.find_spec("matplotlib") is None:
            pytest.skip("matplotlib is not installed (the `plot` extra)")
        args = [str(tmp_path / "surrogates.png")]
    if script.name == "spiking_neuron.py" and importlib.util.find_spec("matplotlib") is not None:
        args = [str(tmp_path / "monitor.png")]
    if script.name.startswith("tensorflow_") and importlib.util.find_spec("tensorflow") is None:
        if os.environ.get("GRADOVERRIDE_REQUIRE_TENSORFLOW") == "1":
            pytest.fail("TensorFlow is required here (GRADOVERRIDE_REQUIRE_TENSORFLOW=1)")
        pytest.skip("TensorFlow is not installed (pip install 'gradoverride[tensorflow]')")
    result = _run(str(script.relative_to(ROOT)), *args)
    if script.name == "quickstart.py":
        _check_quickstart(result.stdout, result.stderr)
    elif script.name == "tensorflow_ste.py":
        match = re.search(r"loss fell from ([-+0-9.eE]+) to ([-+0-9.eE]+)", result.stdout)
        assert match, f"no 'loss fell from A to B' line in:\n{result.stdout}"
        first, last = float(match.group(1)), float(match.group(2))
        assert last < first, f"loss did not fall: {first} -> {last}"
    elif script.name == "domain_adversarial.py":
        _check_domain_adversarial(result.stdout)
    elif script.name == "blackbox_shortest_path.py":
        _check_shortest_path(result.stdout)
    elif script.name in ("binarized_mlp.py", "spiking_neuron.py"):
        _check_rose(result.stdout, "accuracy", minimum=0.9)
        if script.name == "binarized_mlp.py":
            _check_gradient_mismatch(result.stdout)
        if script.name == "spiking_neuron.py":
            _check_spiking_monitor(result.stdout, tmp_path / "monitor.png" if args else None)
    elif script.name == "plot_surrogates.py":
        written = tmp_path / "surrogates.png"
        assert written.is_file() and written.stat().st_size > 0, result.stdout
        assert f"wrote {written}" in result.stdout


_NUMBER = r"([0-9]+\.[0-9]+)"


def _check_rose(out: str, what: str, minimum: float) -> None:
    """`<what> rose from A to B` with B above `minimum` and above A."""
    match = re.search(rf"{what} rose from {_NUMBER} to {_NUMBER}", out)
    assert match, f"no '{what} rose from A to B' line in:\n{out}"
    first, last = map(float, match.groups())
    assert last > first and last >= minimum, out


def _check_gradient_mismatch(out: str) -> None:
    """A gradient_report for each clip setting: the four binarizations (two activations at
    that clip, two weights at 1), each with a cosine in [-1, 1] and a positive norm ratio
    against its clamp proxy."""
    for clip in ("1.0", "3.0"):
        table = out.split(f"gradient mismatch, activations clipped at {clip}:\n", 1)
        assert len(table) == 2, f"no gradient mismatch report for clip={clip}:\n{out}"
        rows = re.findall(
            r"^([0-9]): binarize\(clip=([0-9.]+), inclusive=True, keep='input'\)\s+recipe\s+1"
            rf"\s+(-?{_NUMBER})\s+([0-9][0-9.e+-]*)\s+clamp\(x, -([0-9]), ([0-9])\)$",
            table[1].split("\n\n", 1)[0], re.M)
        assert [(r[0], r[1]) for r in rows] == [
            ("2", clip), ("3", "1.0"), ("5", clip), ("6", "1.0")], table[1]
        for _, _, cosine, _, ratio, low, high in rows:
            assert -1 <= float(cosine) <= 1 and float(ratio) > 0, table[1]
            assert low == high, table[1]


def _check_spiking_monitor(out: str, plot: Path | None) -> None:
    """The monitor's summary: a row for each spike layer, recorded every 10th of 81 steps,
    25 calls (time steps) a step; and the plot, when matplotlib is there."""
    assert "go.monitor of SpikingNet: 81 steps, every 10" in out, out
    for layer in ("hidden", "readout"):
        match = re.search(rf"^{layer}: spike\(.*\)\s+recipe\s+9\s+225\s", out, re.MULTILINE)
        assert match, f"no monitor row for {layer} in:\n{out}"
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"wrote {plot}" in out


def _check_domain_adversarial(out: str) -> None:
    """Domain accuracy falls toward chance (0.5), and target-domain task accuracy rises well
    above that of the same classifier trained on the source alone (near chance)."""
    match = re.search(
        rf"domain accuracy fell from {_NUMBER} to {_NUMBER} \(chance 0\.5\); "
        rf"task accuracy \(target\) rose from {_NUMBER} \(source alone\) to {_NUMBER}",
        out,
    )
    assert match, f"no 'domain accuracy fell from ... task accuracy rose from ...' line:\n{out}"
    domain_first, domain_last, task_first, task_last = map(float, match.groups())
    assert domain_last < domain_first - 0.2, out
    assert abs(domain_last - 0.5) < 0.15, f"domain accuracy {domain_last} is not near chance"
    assert task_last > task_first + 0.3 and task_last > 0.85, out


def _check_shortest_path(out: str) -> None:
    """Held-out Hamming loss falls and the share of optimal paths rises."""
    match = re.search(
        rf"Hamming loss fell from {_NUMBER} to {_NUMBER}; "
        rf"optimal paths rose from {_NUMBER} to {_NUMBER}",
        out,
    )
    assert match, f"no 'Hamming loss fell from ... optimal paths rose from ...' line:\n{out}"
    hamming_first, hamming_last, optimal_first, optimal_last = map(float, match.groups())
    assert hamming_last < hamming_first / 2, out
    assert optimal_last > optimal_first + 0.4, out


def test_overhead_benchmark_quick() -> None:
    out = _run("benchmarks/overhead.py", "--quick").stdout
    assert re.search(r"^\s*go\.custom_backward\s+[0-9.]+ us\s+ratio [0-9.]+\s*$", out, re.M), out
    assert re.search(r"^\s*rule naming nothing\b.*:\s*0\s*$", out, re.M), out


def test_flow_benchmark_quick() -> None:
    """The reversal benchmark prints a ratio per form and shape; against pytorch-revgrad only
    when it is installed (an optional peer, absent in CI), and says so otherwise."""
    out = _run("benchmarks/flow.py", "--quick").stdout
    ratios = re.findall(r"^\s*reverse_grad\(\)(?:\.module\(\))?\s+[0-9.]+ us\s+ratio [0-9.]+$",
                        out, re.M)
    if "pytorch-revgrad not installed" in out.splitlines()[0]:
        assert "no peer comparison" in out, out
        assert len(ratios) == 3, out
    else:
        assert len(ratios) == 9, out
        assert len(re.findall(r"^\s*pytorch_revgrad\.", out, re.M)) == 6, out


def test_ste_benchmark_quick() -> None:
    out = _run("benchmarks/ste.py", "--quick").stdout
    assert re.search(r"^\s*go\.straight_through\s+[0-9.]+ ms\s+ratio to idiom [0-9.]+\s+"
                     r"saved bytes 0\s*$", out, re.M), out
    assert re.search(r"keep='mask'.*held for backward", out), out
    # Every spike preset is timed against its peer function, where the peer is installed
    # (snnTorch's LSO, whose function raises, says why it is not).
    import peers

    from gradoverride import recipes

    for name in recipes.SPIKE_PRESETS:
        if peers.import_peer(peers.library(name)) is not None:
            assert re.search(rf"^\s*{re.escape(name)}\s+(peer .* ratio [0-9.]+|not timed: )",
                             out, re.M), name


def test_modules_benchmark_quick() -> None:
    out = _run("benchmarks/modules.py", "--quick").stdout
    for case in ("go.Module", "go.override_backward", "go.grad_hook(at='inputs')",
                 "go.grad_hook(at='outputs')", "go.grad_hook(at='parameters')",
                 "register_full_backward_hook", "tensor hooks registered once",
                 "go.Module with a submodule", "go.Module, owns='x'"):
        assert re.search(rf"^  {re.escape(case)}\s+[\d.]+ us\s+ratio [\d.]+$", out, re.M), (
            case, out
        )


def test_spiking_benchmark_quick() -> None:
    out = _run("benchmarks/spiking.py", "--quick").stdout
    for case in ("hand-written Function", "spike.preset('snntorch.atan')"):
        assert re.search(rf"^  {re.escape(case)}\s+[\d.]+ ms\s+ratio [\d.]+$", out, re.M), (
            case, out
        )


def test_monitor_benchmark_quick() -> None:
    out = _run("benchmarks/monitor.py", "--quick").stdout
    for case in ("small MLP", "spiking", "binarized"):
        for every in (1, 10):
            # (the steady state's ratio, then what a new monitor's first step adds)
            line = rf"^{re.escape(case)}\s+{every}\s+[\d.]+ ms\s+[\d.]+x\s+-?[\d.]+ ms$"
            assert re.search(line, out, re.M), (case, every, out)


def test_monitor_benchmark_phases_quick() -> None:
    out = _run("benchmarks/monitor.py", "--phases", "--quick").stdout
    # 2 rounds of 20 steps of each case; with every=10, 2 steps of each 20 are recorded
    counts = {"plain": 40, "recorded": 4, "not recorded": 36}
    for case in ("small MLP", "spiking", "binarized"):
        for steps, count in counts.items():
            # (the median microseconds of the forward, the backward and the optimizer, and
            # how many steps they are over)
            line = rf"^{re.escape(case)}\s+{steps}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+{count}$"
            assert re.search(line, out, re.M), (case, steps, out)
        assert re.search(rf"^{re.escape(case)}\s+every=10\s+[\d.]+x ", out, re.M), (case, out)


BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_every_benchmark_takes_device(script: Path) -> None:
    # benchmarks/gpu.sh runs each with --device cuda.
    assert "add_device_argument(parser)" in script.read_text(encoding="utf-8"), script.name


NO_CUDA = pytest.mark.skipif(
    importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available(),
    reason="a GPU is here: the script would run",
)


@NO_CUDA
def test_a_benchmark_with_device_cuda_fails_clearly_without_cuda() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/modules.py", "--quick", "--device", "cuda"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert result.returncode != 0
    assert "--device cuda: CUDA is not available to this torch" in result.stderr, result.stderr


@NO_CUDA
def test_gpu_script_fails_clearly_without_cuda() -> None:
    result = subprocess.run(
        ["bash", "benchmarks/gpu.sh"], cwd=ROOT, capture_output=True, text=True,
        check=False, env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 2, result
    assert "benchmarks/gpu.sh: CUDA is not available to torch" in result.stderr, result.stderr
    assert result.stdout == "", "it ran something before checking for a GPU"


def test_tensorflow_benchmark_quick() -> None:
    if importlib.util.find_spec("tensorflow") is None:
        if os.environ.get("GRADOVERRIDE_REQUIRE_TENSORFLOW") == "1":
            pytest.fail("TensorFlow is required here (GRADOVERRIDE_REQUIRE_TENSORFLOW=1)")
        pytest.skip("TensorFlow is not installed (pip install 'gradoverride[tensorflow]')")
    out = _run("benchmarks/tf_overhead.py", "--quick").stdout
    ratios = re.findall(r"^\s*go\.custom_backward\s+[0-9.]+ us\s+ratio [0-9.]+$", out, re.M)
    assert len(ratios) == 4, out  # two shapes, eager and tf.function
    out = _run("benchmarks/keras_layers.py", "--quick").stdout
    ratios = re.findall(r"^\s*gradoverride\s+[0-9.]+ us\s+ratio [0-9.]+$", out, re.M)
    assert len(ratios) == 6, out  # three layers, eager and tf.function


def test_import_cost_benchmark_quick() -> None:
    """`import gradoverride` loads no TensorFlow (the number itself is the benchmark's)."""
    out = _run("benchmarks/import_cost.py", "--quick").stdout
    assert re.search(r"^import gradoverride \(after torch\): [0-9.]+ ms", out, re.M), out
    assert re.search(r"imported by `import gradoverride` or `import gradoverride\.recipes`: "
                     r"yes$", out, re.M), out


def test_override_cycles_benchmark_quick() -> None:
    out = _run("benchmarks/override_cycles.py", "--quick").stdout
    assert re.search(r"generated source held in linecache: 0\.00 MB$", out, re.M), out


def test_tensorflow_example_without_tensorflow_says_what_to_install(tmp_path: Path) -> None:
    # A `tensorflow` package that fails to import stands in for a machine without TensorFlow.
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text("raise ImportError('no tensorflow')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "examples/tensorflow_ste.py"], cwd=ROOT, env=env, capture_output=True,
        text=True, check=False,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "pip install -e '.[tensorflow]'" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_gpu_table_reads_the_benchmarks_lines() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _gpu_table
    finally:
        sys.path.pop(0)
    log = (
        "torch 2.13, device cuda, 1 thread\n\n"
        "go.Module: x * weights, forward+backward:\n"
        "  (ratio to the fastest of: hand-made Function module)\n"
        "  hand-made Function module               114.1 us   ratio 1.000\n"
        "  go.Module, owns=('x', 'weights')        128.7 us   ratio 1.122\n"
        "3. recipes against peers, (64, 64) float32, forward + backward (ratio ours/peer):\n"
        "  snntorch atan                      peer    0.20 ms   ours    0.16 ms   ratio 0.783\n"
    )
    assert _gpu_table.rows("modules", log) == [
        ("go.Module: x * weights, forward+backward", "hand-made Function module", "114.1 us",
         "1.000"),
        ("go.Module: x * weights, forward+backward", "go.Module, owns=('x', 'weights')",
         "128.7 us", "1.122"),
        ("3. recipes against peers, (64, 64) float32, forward + backward (ratio ours/peer)",
         "snntorch atan", "0.20 ms", "0.783"),
    ]
    assert _gpu_table.rows("tests", "12 passed, 3 skipped in 4.0s\n") == [
        ("", "12 passed, 3 skipped in 4.0s", "", "")
    ]
