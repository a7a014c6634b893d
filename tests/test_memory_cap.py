"""Memory a run may use and what it used: the GPU memory cap (`--gpu-mem`), the host memory check, and memory
measured by the planner's categories beside the predicted (executor/loop/device.py, executor/loop/meter.py)."""

import io
import sys

import pytest
import torch
from rich.console import Console

from fastml import cli, hwprofiles
from fastml.config import UserError
from fastml.plan import MEMORY_CATEGORIES, TIME_COMPONENTS, Hardware, Knobs, Plan, Predicted, Training, save_plan
from fastml.spec import PRESETS
import fastml.executor.loop.train  # noqa: F401  (the module whose train() `no_training` replaces)
from fastml.executor.loop.device import apply_memory_cap, check_host_memory, with_gpu_memory_cap
from fastml.executor.loop.display import memory_table, print_summary
from fastml.executor.loop.meter import Meter, gpu_memory, host_memory, storage_bytes

GIB = 2**30
CUDA = torch.device("cuda", 0)


def tiny_plan(device="cpu", predicted=None, gpu_memory_bytes=0, micro_batch_size=4, grad_accum_steps=1):
    return Plan(model=PRESETS["tiny"],
                training=Training(seq_len=64, global_batch_tokens=64 * micro_batch_size * grad_accum_steps, steps=2),
                hardware=Hardware(device=device, gpu_memory_bytes=gpu_memory_bytes),
                knobs=Knobs(micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps),
                predicted=predicted)


def predicted(gpu=None, host=None):
    """A prediction with these GPU and host bytes by category (0 for the others)."""
    gpu = {name: (gpu or {}).get(name, 0) for name in MEMORY_CATEGORIES}
    host = {name: (host or {}).get(name, 0) for name in MEMORY_CATEGORIES}
    return Predicted(step_time_s=1.0, tokens_per_s=256.0, mfu=0.0, peak_memory_bytes=sum(gpu.values()),
                     memory_bytes=gpu, host_memory_bytes=host, time_s=dict.fromkeys(TIME_COMPONENTS, 0.0),
                     usd_per_million_tokens=0.0, kwh_per_million_tokens=0.0)


# --- the storage walk -------------------------------------------------------------------------------------------

def test_views_of_one_flat_buffer_count_once_and_whole():
    flat = torch.empty(1000)  # 4000 bytes
    views = [flat[:100].view(10, 10), flat[100:600], flat[600:]]
    gpu, host = storage_bytes({"optimizer_states": views, "gradients": [torch.empty(3, dtype=torch.bfloat16)]})
    assert host["optimizer_states"] == 4000
    assert host["gradients"] == 6
    assert storage_bytes({"optimizer_states": [flat[:10]]})[1]["optimizer_states"] == 4000  # the whole buffer stays
    assert sum(gpu.values()) == 0


def test_a_tensor_listed_twice_counts_once_under_its_first_category():
    weight, state = torch.empty(8, 8), torch.empty(8, 8)
    _, host = storage_bytes({"master_weights": [weight], "weights": [weight, weight], "optimizer_states": [state]})
    assert (host["weights"], host["master_weights"], host["optimizer_states"]) == (256, 0, 256)


def test_tensors_split_between_gpu_and_host_and_missing_gradients_are_passed_over():
    on_gpu = lambda t: t.dtype == torch.bfloat16  # stands in for t.is_cuda on a machine without a GPU
    weights = [torch.empty(4, 4, dtype=torch.bfloat16), torch.empty(2, dtype=torch.bfloat16)]
    pinned_states = [torch.empty(4, 4), torch.empty(2)]
    gpu, host = storage_bytes({"weights": weights, "gradients": [None, weights[1].clone()],
                               "optimizer_states": pinned_states, "activations": [torch.empty(5)]}, on_gpu=on_gpu)
    assert (gpu["weights"], gpu["gradients"], gpu["optimizer_states"]) == (36, 4, 0)
    assert (host["weights"], host["optimizer_states"], host["activations"]) == (0, 72, 20)


def test_listing_a_category_that_is_not_a_tensor_list_is_refused():
    with pytest.raises(ValueError, match="workspace"):
        storage_bytes({"workspace": [torch.empty(1)]})
    with pytest.raises(ValueError, match="activations on the GPU"):
        storage_bytes({"activations": [torch.empty(1)]}, on_gpu=lambda t: True)


# --- measured categories ----------------------------------------------------------------------------------------

def test_gpu_categories_add_up_to_the_peak():
    listed = {"weights": 100, "master_weights": 200, "gradients": 100, "optimizer_states": 400, "comm_buffers": 0,
              "activations": 0}
    measured = gpu_memory(listed, forward_kept=300, peak=1500)
    assert measured["activations"] == 300 and measured["workspace"] == 400
    assert sum(measured.values()) == 1500
    assert gpu_memory(listed, 300, peak=1000)["workspace"] == 0  # gradients and activations never all alive at once
    assert gpu_memory(listed, None, peak=1500)["workspace"] is None  # the forward pass was not measured
    assert gpu_memory(None, 300, peak=1500) == dict.fromkeys(MEMORY_CATEGORIES) | {"activations": 300}


def test_host_workspace_is_the_rest_of_the_process():
    listed = {"weights": 0, "master_weights": 10, "gradients": 0, "optimizer_states": 20, "comm_buffers": 0,
              "activations": 30}
    measured = host_memory(listed, peak_rss=1000, on_gpu=True)
    assert (measured["optimizer_states"], measured["activations"], measured["workspace"]) == (20, 30, 940)
    assert host_memory(listed, 1000, on_gpu=False)["activations"] is None  # a CPU's activations are not listed
    assert host_memory(None, 1000, on_gpu=True) == dict.fromkeys(MEMORY_CATEGORIES)


def test_meter_on_a_cpu_measures_the_listed_tensors_in_host_memory():
    weights, states = [torch.randn(64, 64), torch.randn(64)], [torch.zeros(64, 64), torch.zeros(64)]
    meter = Meter(tiny_plan(), torch.device("cpu"), lambda: {"weights": weights, "optimizer_states": states})
    with meter.forward():
        pass
    meter.sample_states()
    meter.measure({"loss": 1.0, "skipped": False})
    summary = meter.summary()
    host = summary["host_memory_bytes"]
    assert summary["memory_bytes"] is None and summary["peak_gpu_reserved_bytes"] is None
    assert host["weights"] == host["optimizer_states"] == 65 * 64 * 4
    assert host["workspace"] == summary["peak_host_memory_bytes"] - 2 * 65 * 64 * 4
    assert host["activations"] is None


def test_the_closing_table_shows_predicted_beside_measured_by_category():
    plan = tiny_plan("cuda", predicted(gpu={"weights": 3 * GIB, "activations": 5 * 2**20},
                                       host={"optimizer_states": 24 * GIB}))
    summary = {"memory_bytes": dict.fromkeys(MEMORY_CATEGORIES, 0) | {"weights": 3 * GIB + 2**29},
               "host_memory_bytes": dict.fromkeys(MEMORY_CATEGORIES) | {"optimizer_states": 25 * GIB}}
    assert table_rows(plan, summary)[:3] == [["GPU predicted", "GPU measured", "host predicted", "host measured"],
                                             ["weights", "3.00 GiB", "3.50 GiB", "0", "n/a"],
                                             ["master_weights", "0", "0", "0", "n/a"]]
    assert table_rows(plan, summary)[4:6] == [["optimizer_states", "0", "0", "24.00 GiB", "25.00 GiB"],
                                              ["activations", "5.0 MiB", "0", "0", "n/a"]]
    on_cpu = tiny_plan("cpu", predicted(gpu={"weights": 3 * GIB}, host={"weights": GIB}))  # the "GPU" is the host
    assert table_rows(on_cpu, summary)[:2] == [["host predicted", "host measured"], ["weights", "4.00 GiB", "n/a"]]


def test_the_run_shows_the_memory_table_only_when_it_measured_by_category():
    plan = tiny_plan("cuda", predicted(gpu={"weights": GIB}))
    summary = {"steps": 2, "first_loss": 5.0, "last_loss": 4.0, "skipped_steps": 0, "step_time_s": 1.0,
               "tokens_per_s": 256.0, "mfu": None, "mfu_peak": "n/a", "total_time_s": 2.0,
               "peak_gpu_memory_bytes": GIB, "peak_host_memory_bytes": GIB,
               "memory_bytes": dict.fromkeys(MEMORY_CATEGORIES), "host_memory_bytes": dict.fromkeys(MEMORY_CATEGORIES)}

    def shown(summary):
        console = Console(file=io.StringIO(), width=200)
        print_summary(console, plan, summary)
        return "memory by category" in console.file.getvalue()
    assert not shown(summary)
    assert shown(summary | {"memory_bytes": summary["memory_bytes"] | {"activations": 2**20}})


def table_rows(plan, summary):
    console = Console(file=io.StringIO(), width=200)
    console.print(memory_table(plan, summary))
    lines = [line for line in console.file.getvalue().splitlines() if line.startswith(("┃", "│"))]
    cells = (line.strip("┃│").replace("┃", "│").split("│") for line in lines)
    return [[cell.strip() for cell in row if cell.strip()] for row in cells]


# --- the GPU memory cap -----------------------------------------------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda as it would show a GPU of 8 GiB, on a machine without one; returns the memory fractions set."""
    fractions = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (7 * GIB, 8 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: fractions.append(fraction))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # training_device sets it otherwise
    return fractions


def test_a_gpu_memory_cap_above_the_gpu_or_for_a_cpu_is_refused(fake_gpu):
    with pytest.raises(UserError, match=r"--gpu-mem: 16.0 GiB is more than the 8.0 GiB of this GPU \(Fake GPU\)"):
        with_gpu_memory_cap(tiny_plan("cuda"), 16 * GIB)
    with pytest.raises(UserError, match="--gpu-mem: the plan trains on a CPU"):
        with_gpu_memory_cap(tiny_plan("cpu"), GIB)
    capped = with_gpu_memory_cap(tiny_plan("cuda", gpu_memory_bytes=6 * GIB), 4 * GIB)  # --gpu-mem wins
    assert capped.hardware.gpu_memory_bytes == 4 * GIB
    assert fake_gpu == []  # checked only: the cap is set by the run (apply_memory_cap)
    big = tiny_plan("cuda", predicted=predicted(gpu={"weights": 5 * GIB}))
    with pytest.raises(UserError, match=r"--gpu-mem: the plan needs 5.0 GiB .* more than the 4.0 GiB cap"):
        with_gpu_memory_cap(big, 4 * GIB)


def test_the_cap_in_effect_is_set_and_said_in_one_line(fake_gpu):
    console = Console(file=io.StringIO(), width=200)
    assert apply_memory_cap(tiny_plan("cuda", gpu_memory_bytes=2 * GIB), CUDA, console) == 2 * GIB
    # A plan made for this GPU names its profile's memory, which can be more than CUDA counts: the whole GPU.
    assert apply_memory_cap(tiny_plan("cuda", gpu_memory_bytes=9 * GIB), CUDA, console) is None
    assert apply_memory_cap(tiny_plan("cuda"), CUDA, console) is None
    assert fake_gpu == [0.25, 1.0, 1.0]  # set every time: a process that trains several plans gets each one's cap
    assert console.file.getvalue().splitlines() == ["GPU memory: capped at 2.0 GiB of the 8.0 GiB of the Fake GPU",
                                                    "GPU memory: all 8.0 GiB of the Fake GPU (no cap)",
                                                    "GPU memory: all 8.0 GiB of the Fake GPU (no cap)"]
    assert apply_memory_cap(tiny_plan("cpu"), torch.device("cpu"), console) is None and len(fake_gpu) == 3


@pytest.fixture
def no_training(monkeypatch):
    """`fastml run` must stop before it trains."""
    def train(*args, **kwargs):
        raise AssertionError("trained")
    monkeypatch.setattr(sys.modules["fastml.executor.loop.train"], "train", train)


@pytest.mark.parametrize("device, gpu_mem, message", [
    ("cuda", "16GiB", "fastml: error: --gpu-mem: 16.0 GiB is more than the 8.0 GiB of this GPU (Fake GPU)"),
    ("cpu", "16GiB", "fastml: error: --gpu-mem: the plan trains on a CPU, which has no GPU memory to cap"),
    ("cuda", "0", "fastml: error: --gpu-mem: 0 is outside the allowed range [1, inf)"),
    ("cuda", "lots", "fastml: error: --gpu-mem: 'lots' is not a size"),
])
def test_run_refuses_a_bad_gpu_memory_cap_in_one_line(tmp_path, capsys, fake_gpu, no_training, device, gpu_mem,
                                                      message):
    save_plan(tiny_plan(device), tmp_path / "plan.json")
    assert cli.main(["run", str(tmp_path / "plan.json"), "--gpu-mem", gpu_mem]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


# --- the host memory check ----------------------------------------------------------------------------------------

def test_a_plan_whose_host_memory_does_not_fit_is_refused(monkeypatch):
    monkeypatch.setattr(hwprofiles, "host_memory_bytes", lambda: 64 * GIB)
    too_much = tiny_plan("cuda", predicted(host={"optimizer_states": 96 * GIB, "workspace": 2 * GIB}))
    with pytest.raises(UserError, match=r"^host memory: the plan needs 98.0 GiB \(optimizer_states 96.0 GiB, "
                                        r"workspace 2.0 GiB\) but this machine has 64.0 GiB"):
        check_host_memory(too_much)
    check_host_memory(tiny_plan("cuda", predicted(gpu={"weights": 100 * GIB}, host={"workspace": 2 * GIB})))
    with pytest.raises(UserError, match=r"needs 102.0 GiB \(training on the CPU 100.0 GiB, workspace 2.0 GiB\)"):
        check_host_memory(tiny_plan("cpu", predicted(gpu={"weights": 100 * GIB}, host={"workspace": 2 * GIB})))
    check_host_memory(tiny_plan("cpu"))  # no predictions: nothing to check against


# --- on a GPU -----------------------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")


def nbytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.gpu
@needs_gpu
def test_meter_measures_the_tensors_and_the_forward_pass_on_gpu():
    """Two micro-batches a step keep the gradients alive through the second forward pass, so the peak holds every
    category at once and the measured ones add up to it, with a workspace that is not clamped."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 512)).to(CUDA)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, fused=True)
    states = lambda: [s[key] for s in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    meter = Meter(tiny_plan("cuda"), CUDA, lambda: {"weights": params, "gradients": [p.grad for p in params],
                                                     "optimizer_states": states()})
    rows = 256
    for _ in range(2):
        for _ in range(2):
            x = torch.randn(rows, 512, device=CUDA)
            with meter.forward():
                loss = model(x).square().mean()
            loss.backward()
        meter.sample_states()
        optimizer.step()
        optimizer.zero_grad()
        meter.measure({"loss": loss.item(), "skipped": False})
    measured = meter.summary()["memory_bytes"]
    assert measured["weights"] == measured["gradients"] == nbytes(params)
    assert measured["optimizer_states"] == nbytes(states()) == 2 * nbytes(params)
    assert measured["master_weights"] == measured["comm_buffers"] == 0
    # Kept for the backward pass: the first linear's output (GELU's input), GELU's output (the second linear's
    # input), the second linear's output (square's input), and the loss; fp32.
    kept = 4 * rows * (4096 + 4096 + 512)
    assert kept <= measured["activations"] <= kept + 2**16
    assert measured["workspace"] > 0
    assert sum(measured.values()) == torch.cuda.max_memory_allocated(CUDA)


@pytest.mark.gpu
@needs_gpu
def test_an_allocation_beyond_the_cap_runs_out_of_memory():
    cap = GIB
    console = Console(file=io.StringIO())
    try:
        assert apply_memory_cap(tiny_plan("cuda", gpu_memory_bytes=cap), CUDA, console) == cap
        half = torch.empty(cap // 2, dtype=torch.uint8, device=CUDA)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(cap, dtype=torch.uint8, device=CUDA)
        del half
        assert apply_memory_cap(tiny_plan("cuda"), CUDA, console) is None
        torch.empty(cap + 2**21, dtype=torch.uint8, device=CUDA)  # the whole GPU again
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, CUDA)
        torch.cuda.empty_cache()


@pytest.mark.gpu
@needs_gpu
def test_a_capped_run_stays_under_its_cap_and_measures_every_category():
    """Through train(): the cap is set and said, and the measured model states are the planner's (no offload).
    Micro-batch 4 x 2 keeps the gradients alive through the second forward pass (see the test above)."""
    from fastml.plan import pinned
    from fastml.planner.planner import make_plan
    from fastml.executor.loop.train import train

    cap = 2 * GIB
    plan = make_plan(seq_len=256, global_batch_tokens=256 * 8, steps=3, gpus=1,
                     overrides=pinned(micro_batch_size=4)).plan
    plan = with_gpu_memory_cap(plan, cap)
    console = Console(file=io.StringIO(), width=200)
    try:
        summary = train(plan, show_progress=False, console=console)
        assert "GPU memory: capped at 2.0 GiB of the" in console.file.getvalue()
        assert summary["peak_gpu_reserved_bytes"] <= cap
        measured, predicted = summary["memory_bytes"], plan.predicted.memory_bytes
        for name in ("weights", "master_weights", "gradients"):
            assert measured[name] == predicted[name], name
        # Adam's step counts, a few bytes per parameter tensor, may be listed with m and v.
        assert measured["optimizer_states"] == pytest.approx(predicted["optimizer_states"], abs=2**16)
        assert measured["activations"] > 0 and measured["workspace"] > 0
        assert sum(measured.values()) == summary["peak_gpu_memory_bytes"]
        assert summary["host_memory_bytes"]["workspace"] > 0
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(cap + 2**21, dtype=torch.uint8, device=CUDA)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, CUDA)
