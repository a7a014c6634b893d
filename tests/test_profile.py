"""`fastml profile`: topology detection through a fake NVML, the hwprofile it writes, and the real detection."""

import dataclasses
import io
import json
import os
import sys
import types

import pytest
import torch
from rich.console import Console

from fastml import hwprofiles
from fastml.config import UserError
from fastml.hwprofiles import profile as profile_module
from fastml.planner.hardware import load_machine
from fastml.hwprofiles.profile import (detect_topology, linear_shapes, measure_cpu, print_topology, profile,
                                    profile_json, this_cpu_profile)
from fastml.spec import PRESETS

RTX4090 = "NVIDIA GeForce RTX 4090"
RTX4090_MEMORY_BYTES = 24564 * 2**20
H200_MEMORY_BYTES = 143771 * 2**20


FAKE_PEAK = 1e11
FAKE_BANDWIDTH = 2e10


FAKE_THREADS = 4
FAKE_HOST = {"step_s": 0.004, "optimizer_per_block_s": 0.001, "head_s": 0.003, "block_pass_s": 0.0025}
"""The training loop's host time on the fake CPU (hwprofiles/host.py's figures)."""


def fake_cpu_measurements(monkeypatch, tmp_path, one_thread_efficiency: float = 0.4) -> dict:
    """This CPU's measurements replaced by fixed numbers, cached under tmp_path, on FAKE_THREADS torch threads: a GEMM
    with all the threads at 40% of the peak plus 20 µs, and with one thread at `one_thread_efficiency` of its share
    (1/FAKE_THREADS) of the peak plus 20 µs (a share of the threads in between); attention at 20%; a block's
    elementwise work at a tenth of the bandwidth; the training loop's host time FAKE_HOST. Returns the counts of
    measurements taken ("base": peak and bandwidth, "linear": GEMM shapes, "attention": attention shapes,
    "elementwise": elementwise shapes, "host": the training loop)."""
    monkeypatch.setenv("FASTML_CACHE", str(tmp_path / "cache"))
    threads = {"now": FAKE_THREADS}
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads["now"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.update(now=n))
    calls = {"base": 0, "linear": 0, "attention": 0, "elementwise": 0, "host": 0}

    def base():
        calls["base"] += 1
        return hwprofiles.CpuMeasurements(key=hwprofiles.cpu_key(), date="2026-11-30",
                                          peak_fp32_flops_per_s=FAKE_PEAK, memory_bytes_per_s=FAKE_BANDWIDTH)

    def linear(tokens, out, inp):
        calls["linear"] += 1
        share = threads["now"] / FAKE_THREADS
        efficiency = 0.4 if share == 1 else one_thread_efficiency
        return 6 * tokens * out * inp / (efficiency * share * FAKE_PEAK) + 2e-5

    def attention(batch, seq_len, heads, kv_heads, head_dim):
        calls["attention"] += 1
        return 3.5 * 2 * batch * seq_len**2 * heads * head_dim / (0.2 * FAKE_PEAK * threads["now"] / FAKE_THREADS)

    def elementwise(tokens, hidden, heads, kv_heads, head_dim, ffn):
        calls["elementwise"] += 1
        return tokens * (hidden + ffn) * 4 / (0.1 * FAKE_BANDWIDTH * threads["now"] / FAKE_THREADS)

    def host(progress):
        calls["host"] += 1
        return dict(FAKE_HOST)

    monkeypatch.setattr(profile_module, "_measure_cpu_base", base)
    monkeypatch.setattr(profile_module, "_linear_seconds", linear)
    monkeypatch.setattr(profile_module, "_attention_seconds", attention)
    monkeypatch.setattr(profile_module, "_elementwise_seconds", elementwise)
    monkeypatch.setattr(profile_module, "_cpu_host_overhead", host)
    return calls


def fake_nvml(gpus: list[dict], p2p_status: int | None, level) -> types.ModuleType:
    """A stand-in for pynvml. Each GPU dict: name, memory_bytes, pcie (gen, max_gen, width, max_width),
    num_nvlinks, and numa/affinity/num_sms, None where the fake says "not supported"; p2p_status None leaves the
    binding without nvmlDeviceGetP2PStatus; level(i, j) is the common ancestor, None for "not supported"."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_InvalidArgument(NVMLError):
        pass

    def supported(value):
        if value is None:
            raise NVMLError_NotSupported("Not Supported")
        return value

    def nvlink_state(handle, link):
        if gpus[handle]["num_nvlinks"] == 0:
            raise NVMLError_NotSupported("Not Supported")
        if link >= 18:
            raise NVMLError_InvalidArgument("Invalid Argument")
        return int(link < gpus[handle]["num_nvlinks"])

    def affinity(handle, num_words):
        return [*supported(gpus[handle]["affinity"]), *[0] * num_words][:num_words]

    nvml.__dict__.update(
        NVMLError=NVMLError, NVML_NVLINK_MAX_LINKS=36, NVML_FEATURE_ENABLED=1,
        NVML_P2P_CAPS_INDEX_READ=(0,),  # a tuple, as nvidia-ml-py 13 defines it
        NVML_P2P_STATUS_OK=0, NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED=1, NVML_P2P_STATUS_GPU_NOT_SUPPORTED=2,
        NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED=3, NVML_P2P_STATUS_DISABLED_BY_REGKEY=4,
        NVML_P2P_STATUS_NOT_SUPPORTED=5, NVML_TOPOLOGY_INTERNAL=0, NVML_TOPOLOGY_SINGLE=10,
        NVML_TOPOLOGY_MULTIPLE=20, NVML_TOPOLOGY_HOSTBRIDGE=30, NVML_TOPOLOGY_NODE=40, NVML_TOPOLOGY_SYSTEM=50,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlSystemGetDriverVersion=lambda: "580.159.04",
        nvmlDeviceGetName=lambda h: gpus[h]["name"],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=gpus[h]["memory_bytes"], used=0),
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: gpus[h]["pcie"][0],
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: gpus[h]["pcie"][1],
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: gpus[h]["pcie"][2],
        nvmlDeviceGetMaxPcieLinkWidth=lambda h: gpus[h]["pcie"][3],
        nvmlDeviceGetNvLinkState=nvlink_state, nvmlDeviceGetCpuAffinity=affinity,
        nvmlDeviceGetNumaNodeId=lambda h: supported(gpus[h]["numa"]),
        nvmlDeviceGetAttributes=lambda h: types.SimpleNamespace(multiprocessorCount=supported(gpus[h]["num_sms"])),
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: supported(level(a, b)))
    if p2p_status is not None:
        nvml.nvmlDeviceGetP2PStatus = lambda a, b, index: p2p_status if index == 0 else supported(None)
    return nvml


def rtx4090s(name=RTX4090, memory_bytes=RTX4090_MEMORY_BYTES):
    """Four consumer cards on two CPU sockets, no NVLink, no NUMA or affinity reported, idle links at gen1."""
    return [dict(name=name, memory_bytes=memory_bytes, pcie=(1, 4, 16, 16), num_nvlinks=0, numa=None,
                 affinity=None, num_sms=None) for _ in range(4)]


def h200s():
    return [dict(name="NVIDIA H200", memory_bytes=H200_MEMORY_BYTES, pcie=(5, 5, 16, 16), num_nvlinks=18, numa=i,
                 affinity=[0xFFFFFFFF << 32 * i], num_sms=132) for i in range(2)]


def socket_level(a, b):
    return 40 if a // 2 == b // 2 else 50


def use(monkeypatch, nvml):
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return detect_topology()


def printed(topology) -> str:
    out = io.StringIO()
    print_topology(topology, Console(file=out, width=160, color_system=None))
    return out.getvalue()


def write_and_load(tmp_path, data):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(data))
    return load_machine(str(path))


def test_four_rtx4090s_without_p2p(monkeypatch, tmp_path):
    topology = use(monkeypatch, fake_nvml(rtx4090s(), p2p_status=5, level=socket_level))
    assert topology["no_gpu_reason"] is None and topology["host"]["driver_version"] == "580.159.04"
    assert [g["index"] for g in topology["gpus"]] == [0, 1, 2, 3]
    assert topology["gpus"][0] == {
        "index": 0, "name": RTX4090, "memory_bytes": RTX4090_MEMORY_BYTES,
        "pcie": {"generation": 1, "max_generation": 4, "width": 16, "max_width": 16},
        "num_nvlinks": 0, "numa_node": None, "cpu_affinity": None, "num_sms": None}
    assert topology["p2p"][0] == [None, "not supported", "not supported", "not supported"]
    assert topology["topology"][0] == [None, "NUMA node", "system", "system"]

    data = profile_json(topology)
    machine = write_and_load(tmp_path, data)
    assert machine.gpu.p2p is False and machine.node.gpus_per_node == 4 and machine.num_gpus == 4
    assert machine.gpu.memory_bytes == RTX4090_MEMORY_BYTES
    assert machine.node.host_memory_bytes == topology["host"]["memory_bytes"] > 0
    assert data["gpu"]["pcie"]["generation"] == 4 and data["gpu"]["pcie"]["lanes"] == 16
    assert data["device_names"] == [RTX4090] and data["detected"]["gpus"] == topology["gpus"]
    base = hwprofiles.for_device_name(RTX4090)
    if base is not None:
        assert data["detected"]["base_profile"] == base and machine.profile == f"detected-{base}"
        assert machine.gpu.peak_flops == hwprofiles.load(base)["gpu"]["peak_flops"]
    else:  # no shipped RTX 4090 profile yet: the nearest-memory fallback, tested on its own below
        assert "nearest in GPU memory" in data["detected"]["base_match"]
    assert "gpu.p2p" in data["source"] and "Taken from shipped profile" in data["source"]
    assert "Measured by" not in data["source"] and "measured" not in data  # nothing was

    text = printed(topology)
    assert text.count(RTX4090) == 4 and "24.0" in text and "gen4 x16 (now gen1 x16)" in text
    assert "no NODE" in text and "no SYS" in text and "driver 580.159.04" in text


def test_two_h200s_with_nvlink_and_p2p(monkeypatch, tmp_path):
    topology = use(monkeypatch, fake_nvml(h200s(), p2p_status=0, level=lambda a, b: 50))
    assert [(g["num_nvlinks"], g["numa_node"], g["cpu_affinity"], g["num_sms"]) for g in topology["gpus"]] == \
        [(18, 0, "0-31", 132), (18, 1, "32-63", 132)]
    assert topology["p2p"] == [[None, "ok"], ["ok", None]]
    assert topology["topology"] == [[None, "system"], ["system", None]]

    data = profile_json(topology)
    machine = write_and_load(tmp_path, data)
    assert data["detected"]["base_profile"] == "h200" and machine.profile == "detected-h200"
    assert machine.gpu.p2p is True and machine.node.gpus_per_node == 2
    assert machine.gpu.memory_bytes == H200_MEMORY_BYTES
    assert machine.gpu.nvlink_bytes_per_s == hwprofiles.load("h200")["gpu"]["nvlink_bytes_per_s"]
    assert "its device_names list 'NVIDIA H200'" in data["source"]

    text = printed(topology)
    assert "gen5 x16" in text and "(now" not in text and "ok SYS" in text and "0-31" in text


MEASURED = {"gpu.gemm_efficiency": [[1024, 0.1], [8192, 0.71]], "gpu.hbm_bytes_per_s": 4.0e12,
            "gpu.pcie.h2d_bytes_per_s": 5.0e10, "gpu.pcie.d2h_bytes_per_s": 5.1e10,
            "node.h2d_all_gpus_bytes_per_s": 9.0e10, "node.host_copy_bytes_per_s": 6.0e10,
            "node.cpu_adam_params_per_s": 3.0e9, "launch_s": 3e-6, "quick": True, "date": "2026-12-01",
            "gpu.fp8_cast_bytes_per_s": 3.0e12, "gpu.fp8_gemm_shapes": [[8192, 4096, 4096, 0.6]],
            "gpu.fp8_backward_gemm_shapes": [[8192, 4096, 4096, 0.5]],
            "gpu.attention_shapes": [[64, 1024, 0.25], [64, 4096, 0.45], [128, 2048, 0.38]],
            "gpu.gemm_shapes": [[8192, 4096, 4096, 0.7], [8192, 2048, 2048, 0.6]],
            "gpu.backward_gemm_shapes": [[8192, 4096, 4096, 0.65]], "gpu.sustained_compute_share": 0.9}


def test_measured_rates_are_written_over_the_base_profile_and_plans_use_them(monkeypatch, tmp_path):
    """The profile schema of a measured machine: each rate hwprofiles/measure.py measured replaces the shipped one,
    the source says which, and `fastml plan` for this machine plans with it once `fastml profile` saved it."""
    topology = use(monkeypatch, fake_nvml(h200s(), p2p_status=0, level=lambda a, b: 50))
    data = profile_json(topology, MEASURED)
    machine = write_and_load(tmp_path, data)
    assert machine.gpu.hbm_bytes_per_s == 4.0e12 and machine.gpu.gemm_efficiency == ((1024, 0.1), (8192, 0.71))
    assert (machine.gpu.h2d_bytes_per_s, machine.gpu.d2h_bytes_per_s) == (5.0e10, 5.1e10)
    assert machine.node.cpu_adam_params_per_s == 3.0e9 and machine.node.h2d_all_gpus_bytes_per_s == 9.0e10
    assert machine.gpu.fp8_cast_bytes_per_s == 3.0e12
    assert machine.gpu.sustained_compute_share == 0.9  # the tables' rates, as a training run keeps them
    fp8_peak, bf16_peak = machine.gpu.peak_flops["fp8"] * 0.9, machine.gpu.peak_flops["bf16"] * 0.9
    assert machine.gpu.gemm_seconds(8192, 4096, 4096, "fp8") == pytest.approx(2 * 8192 * 4096**2 / (fp8_peak * 0.6))
    assert machine.gpu.gemm_seconds(8192, 4096, 4096, "fp8", backward=True) == pytest.approx(
        2 * 8192 * 4096**2 / (fp8_peak * 0.5))
    assert machine.gpu.gemm_seconds(8192, 4096, 4096, "bf16") == pytest.approx(
        2 * 8192 * 4096**2 / (bf16_peak * 0.7))
    assert machine.gpu.gemm_seconds(8192, 4096, 4096, "bf16", backward=True) == pytest.approx(
        2 * 8192 * 4096**2 / (bf16_peak * 0.65))
    # a backward shape not measured takes the forward's efficiency
    assert machine.gpu.gemm_seconds(8192, 2048, 2048, "bf16", backward=True) == pytest.approx(
        2 * 8192 * 2048**2 / (bf16_peak * 0.6))
    # an fp8 shape not measured takes the bf16 efficiency, at the fp8 peak
    assert machine.gpu.gemm_seconds(1024, 1024, 1024, "fp8") == pytest.approx(
        machine.gpu.gemm_seconds(1024, 1024, 1024, "bf16") * bf16_peak / fp8_peak)
    assert machine.gpu.peak_flops == hwprofiles.load("h200")["gpu"]["peak_flops"]  # datasheet peaks: not measured
    assert_attention_takes_the_measured_rates(machine)
    assert "Measured by `fastml profile` (--quick, hwprofiles/measure.py): gpu.gemm_efficiency" in data["source"]
    assert data["measured"]["launch_s"] == 3e-6
    monkeypatch.setenv("FASTML_CACHE", str(tmp_path))
    hwprofiles.save_machine_profile(data)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    from fastml.planner.planner import make_plan

    plan = make_plan(trials=10).plan
    assert plan.hardware.profile == "detected-h200" and plan.hardware.num_gpus == 2


def test_a_gpu_machine_is_measured_on_first_use_then_planned_from_its_cache(monkeypatch, tmp_path, capsys):
    """Issue 23: `fastml plan` on a GPU machine nobody profiled measures it first (the quick profile, without building
    the native ops), says so, caches it, and plans with it; the next plan reads the cache; --no-profile plans with
    the shipped figures."""
    from fastml.hwprofiles import measure
    from fastml.planner.planner import make_plan

    use(monkeypatch, fake_nvml(h200s(), p2p_status=0, level=lambda a, b: 50))
    monkeypatch.setenv("FASTML_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    calls = []

    def measure_gpus(*args, **kwargs):
        calls.append(kwargs)
        return {**MEASURED, "not_built": ["node.cpu_adam_params_per_s"],
                "host_overhead.block_pass_s": 0.002, "host_overhead.head_s": 0.001,
                "host_overhead.optimizer_per_block_s": 1e-4, "host_overhead.step_s": 0.004}
    monkeypatch.setattr(measure, "measure_gpus", measure_gpus)
    assert make_plan(trials=10, measure=False).plan.hardware.profile == "h200" and not calls
    plan = make_plan(trials=10).plan
    assert plan.hardware.profile == "detected-h200" and len(calls) == 1 and calls[0]["build_ops"] is False
    said = capsys.readouterr().err
    assert "measuring this machine's 2 x NVIDIA H200 for planning, once" in said
    assert "kept h200's node.cpu_adam_params_per_s (fastml's native ops are not built yet)" in said
    machine = load_machine(hwprofiles.machine_profile("NVIDIA H200", 2))
    assert machine.host_overhead.block_pass_s == 0.002 and machine.gpu.hbm_bytes_per_s == 4.0e12
    assert make_plan(trials=10).plan.hardware.fingerprint == plan.hardware.fingerprint and len(calls) == 1


def assert_attention_takes_the_measured_rates(machine) -> None:
    """Attention's forward time is its FLOPs at the measured efficiency of its head size (the nearest measured), in
    log sequence length between the lengths measured and flat beyond; without measurements, the GEMM curve's. Fewer
    query tiles in flight than where it was measured run at the share x/(x+x0) gives (gpu.attention_half_rate_tiles)."""
    from fastml.planner.costs import _attention_s

    few = dataclasses.replace(machine, gpu=dataclasses.replace(machine.gpu, attention_half_rate_tiles=500.0))
    machine = dataclasses.replace(machine, gpu=dataclasses.replace(machine.gpu, attention_half_rate_tiles=None))

    def seconds(model: str, seq_len: int, on=machine, sequences: int = 1) -> float:
        spec = PRESETS[model]
        return _attention_s(spec.attention_forward_flops_per_token(seq_len) * seq_len * sequences, spec, sequences,
                            seq_len, on, "bf16") / sequences

    def at(model: str, seq_len: int, efficiency: float) -> float:
        spec = PRESETS[model]
        return spec.attention_forward_flops_per_token(seq_len) * seq_len / (machine.gpu.sustained_flops_for("bf16") *
                                                                             efficiency)
    assert seconds("tinyllama-1.1b", 1024) == pytest.approx(at("tinyllama-1.1b", 1024, 0.25))
    assert seconds("tinyllama-1.1b", 2048) == pytest.approx(at("tinyllama-1.1b", 2048, 0.35))  # halfway in log
    assert seconds("tinyllama-1.1b", 8192) == pytest.approx(at("tinyllama-1.1b", 8192, 0.45))
    assert seconds("llama-3.1-8b", 8192) == pytest.approx(at("llama-3.1-8b", 8192, 0.38))
    assert seconds("qwen2.5-0.5b", 512) == pytest.approx(at("qwen2.5-0.5b", 512, 0.25))  # head_dim 64 too
    # the 8B at 2048: 32 heads of 16 tiles a sequence; measured with 8 sequences (4096 tiles), as fast as that
    assert seconds("llama-3.1-8b", 2048, few, sequences=8) == pytest.approx(at("llama-3.1-8b", 2048, 0.38))
    assert seconds("llama-3.1-8b", 2048, few) == pytest.approx(
        at("llama-3.1-8b", 2048, 0.38 * (512 / (512 + 500)) / (4096 / (4096 + 500))))
    unmeasured = dataclasses.replace(machine, gpu=dataclasses.replace(machine.gpu, attention_shapes={}))
    size = (2048 * 32 * 2048 * 64) ** (1 / 3)
    assert seconds("tinyllama-1.1b", 2048, unmeasured) == pytest.approx(
        at("tinyllama-1.1b", 2048, machine.gpu.gemm_efficiency_at(size)))


def test_a_gpu_that_slows_under_sustained_load_prices_its_matmuls_and_attention_slower():
    """The measured rates are of short runs; a training run keeps sustained_compute_share of them."""
    from fastml.planner.costs import _attention_s

    shipped = load_machine(hwprofiles.load("h200"), 1)
    machine, slowed = (dataclasses.replace(shipped, gpu=dataclasses.replace(shipped.gpu, sustained_compute_share=share))
                       for share in (1.0, 0.8))
    spec = PRESETS["llama-3.1-8b"]
    assert slowed.gpu.gemm_seconds(8192, 14336, 4096, "bf16") == pytest.approx(
        machine.gpu.gemm_seconds(8192, 14336, 4096, "bf16") / 0.8)
    assert _attention_s(1e12, spec, 4, 2048, slowed, "bf16") == pytest.approx(
        _attention_s(1e12, spec, 4, 2048, machine, "bf16") / 0.8)


def test_attentions_half_rate_is_what_its_two_measured_rates_imply():
    from fastml.hwprofiles.measure import half_rate_tiles

    def share(tiles: float, x0: float, full_tiles: float) -> float:
        return (tiles / (tiles + x0)) / (full_tiles / (full_tiles + x0))
    assert half_rate_tiles(512, share(512, 300.0, 4096), 4096) == pytest.approx(300.0)
    assert half_rate_tiles(512, 1.0, 4096) == 0.0  # one sequence as fast as many: nothing lost


@pytest.mark.parametrize("field, row", [("attention_shapes", [64, 1024]), ("attention_shapes", [0, 1024, 0.3]),
                                        ("attention_shapes", [64, 1024, -0.3]),
                                        ("backward_gemm_shapes", [8192, 2048, 2048])])
def test_a_bad_row_of_a_measured_table_is_one_error(field, row):
    shipped = hwprofiles.load("h200")
    profile = shipped | {"gpu": shipped["gpu"] | {field: [row]}}  # the shipped one's cached dict stays as it is
    with pytest.raises(UserError, match=rf"gpu\.{field}\[0\]: .* expected \d positive numbers"):
        load_machine(profile, 1)


def test_unknown_gpu_starts_from_the_profile_nearest_in_memory(monkeypatch, tmp_path):
    topology = use(monkeypatch, fake_nvml(rtx4090s("Acme X1", H200_MEMORY_BYTES), p2p_status=0,
                                          level=socket_level))
    data = profile_json(topology)
    base = data["detected"]["base_profile"]
    assert hwprofiles.load(base)["gpu"]["memory_bytes"] == hwprofiles.load("h200")["gpu"]["memory_bytes"]
    assert "nearest in GPU memory: no shipped profile lists 'Acme X1'" in data["source"]
    assert data["device_names"] == ["Acme X1"] and data["name"] == f"detected-{base}"
    assert write_and_load(tmp_path, data).gpu.p2p is True


def test_p2p_and_topology_nvml_cannot_report_count_as_no_p2p(monkeypatch, tmp_path):
    topology = use(monkeypatch, fake_nvml(h200s(), p2p_status=None, level=lambda a, b: None))
    assert topology["p2p"] == [[None, None], [None, None]] and topology["topology"] == topology["p2p"]
    assert write_and_load(tmp_path, profile_json(topology)).gpu.p2p is False
    assert "? ?" in printed(topology)


def test_without_nvml_there_is_no_gpu_and_the_cpu_profile_is_written(monkeypatch, tmp_path):
    calls = fake_cpu_measurements(monkeypatch, tmp_path)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    data = profile(None, Console(file=out, width=160, color_system=None))
    assert "no CUDA GPU found (nvidia-ml-py is not installed" in out.getvalue()
    assert json.loads((tmp_path / "hwprofile.json").read_text()) == data
    machine = load_machine("hwprofile.json")
    assert machine.profile == "detected-cpu" and machine.device == "cpu" and calls["base"] == 1
    assert machine.gpu.memory_bytes == machine.node.host_memory_bytes == data["detected"]["host"]["memory_bytes"] > 0
    assert machine.gpu.peak_flops == {"fp32": FAKE_PEAK}
    assert data["detected"]["host"]["num_cpus"] == os.cpu_count()


def test_nvml_failing_to_start_means_no_gpu(monkeypatch):
    nvml = fake_nvml([], p2p_status=0, level=socket_level)

    def no_library():
        raise nvml.NVMLError("NVML Shared Library Not Found")

    nvml.nvmlInit = no_library
    topology = use(monkeypatch, nvml)
    assert topology["gpus"] == [] and "NVML Shared Library Not Found" in topology["no_gpu_reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path; this machine has a CUDA GPU")
def test_real_detection_without_a_gpu():
    """(`fastml profile` on this CPU, measuring it, is tests/test_cli.py's.)"""
    topology = detect_topology()
    assert topology["gpus"] == [] and topology["no_gpu_reason"] and topology["host"]["memory_bytes"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
@pytest.mark.skipif("CUDA_VISIBLE_DEVICES" in os.environ,
                    reason="NVML sees every GPU of the machine, torch only those in CUDA_VISIBLE_DEVICES")
def test_real_detection_on_gpus(tmp_path, monkeypatch):
    """`fastml profile --quick` on this machine's GPUs: detected, then measured (rates a GPU reaches, not the
    datasheet's), and saved as this machine's profile."""
    monkeypatch.setenv("FASTML_CACHE", str(tmp_path))
    out = io.StringIO()
    data = profile(str(tmp_path / "hw.json"), Console(file=out, width=160, color_system=None), quick=True)
    measured = data["measured"]
    assert 0 < max(e for _, e in data["gpu"]["gemm_efficiency"]) <= 1.0
    assert data["gpu"]["hbm_bytes_per_s"] == measured["gpu.hbm_bytes_per_s"] > 1e11
    assert data["gpu"]["pcie"]["h2d_bytes_per_s"] > 1e9 and data["node"]["cpu_adam_params_per_s"] > 1e7
    assert 0 < measured["launch_s"] < 1e-3
    host = data["host_overhead"]  # the training loop's host time: a block pass is many launches, not a second
    assert 10 * measured["launch_s"] < host["block_pass_s"] < 0.1 and 0 <= host["step_s"] < 1
    attention = data["gpu"]["attention_shapes"]  # --quick: two lengths for each of two head sizes
    assert [row[:2] for row in attention] == [[64, 2048], [64, 8192], [128, 2048], [128, 8192]]
    assert all(0.05 < e < 1.0 for _, _, e in attention)
    assert 0 <= data["gpu"]["attention_half_rate_tiles"] < 1e5  # one sequence of the 8B's shape against eight
    assert 0.3 < data["gpu"]["sustained_compute_share"] <= 1.0
    if torch.cuda.get_device_capability() >= (8, 9):  # --quick: the cast alone, no fp8 GEMM shapes
        assert "fp8_error" not in measured and data["gpu"]["fp8_cast_bytes_per_s"] > 1e11
    assert hwprofiles.machine_profile(torch.cuda.get_device_name(0), torch.cuda.device_count()) == \
        json.loads(json.dumps(data))
    gpus = data["detected"]["gpus"]
    torch_names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    assert len(gpus) == torch.cuda.device_count()
    assert sorted(g["name"] for g in gpus) == sorted(torch_names)
    assert all(g["memory_bytes"] >= torch.cuda.get_device_properties(0).total_memory * 0.99 for g in gpus)
    machine = load_machine(str(tmp_path / "hw.json"))
    assert machine.node.gpus_per_node == len(gpus) and machine.gpu.memory_bytes > 0
    assert all(name in out.getvalue() for name in torch_names)


def test_the_cpu_profile_is_a_hardware_profile_measured_here(monkeypatch, tmp_path):
    fake_cpu_measurements(monkeypatch, tmp_path)
    data = this_cpu_profile(PRESETS["tiny"], 256, (1, 16), say=lambda line: None)
    assert data["device"] == "cpu" and data["name"] == "detected-cpu"
    assert "measured on this machine" in data["source"] and "2026-11-30" in data["source"]
    machine = load_machine(data)
    assert machine.gpu.peak_flops == {"fp32": FAKE_PEAK} and machine.gpu.hbm_bytes_per_s == FAKE_BANDWIDTH
    assert machine.gpu.memory_bytes == machine.node.host_memory_bytes == hwprofiles.host_memory_bytes()
    assert machine.shares_host_memory and machine.usd_per_gpu_hour == 0 and machine.num_gpus == 1
    # Each shape of the model's linear layers, below 40% where the fixed 20 µs weighs; the curve: attention.
    efficiencies = [machine.gpu.gemm_shapes[s] for s in linear_shapes(PRESETS["tiny"], (256, 4096))]
    assert len(machine.gpu.gemm_shapes) == len(efficiencies) == 8  # qkv and the LM head share a shape in tiny
    assert all(0.2 < e <= 0.4 for e in efficiencies) and efficiencies[-1] > efficiencies[0]
    assert [e for _, e in machine.gpu.gemm_efficiency] == [0.2, 0.2]
    assert hwprofiles.peak_flops("cpu", "fp32") == FAKE_PEAK  # what the executor's meter reads
    # A linear layer of the model is timed as measured at its exact shape, forward plus twice the forward.
    spec = PRESETS["tiny"]
    t, n, k = 4096, spec.q_size + 2 * spec.kv_size, spec.hidden_size
    measured = 6 * t * n * k / (0.4 * FAKE_PEAK) + 2e-5
    assert 3 * machine.gpu.gemm_seconds(t, n, k, "fp32") == pytest.approx(measured, rel=1e-3)


def test_a_cpus_elementwise_work_is_priced_as_it_was_measured(monkeypatch, tmp_path):
    """REVIEW: the main job on an AMD EPYC predicted 0.70 of its measured step: a CPU's norms, rotary embedding and
    SwiGLU were priced at its tensor copy's bandwidth and ran about five times slower (silu's exponential, the
    reference SwiGLU's extra passes). The profile measures them: at a measured shape the planner prices a block's
    elementwise work, forward and backward, at the seconds measured; each of 2 processes sharing the CPU (measured
    with half the threads, here at half the speed) at twice them."""
    from fastml.plan import Knobs
    from fastml.planner.costs import layer_work

    fake_cpu_measurements(monkeypatch, tmp_path)
    spec, knobs = PRESETS["tiny"], Knobs(micro_batch_size=4, param_dtype="fp32", matmul_dtype="fp32")
    measured = 1024 * (spec.hidden_size + spec.ffn_hidden_size) * 4 / (0.1 * FAKE_BANDWIDTH)  # the fake's seconds
    for processes in (1, 2):
        data = this_cpu_profile(spec, 256, (4,), say=lambda line: None, processes=processes)
        work = layer_work(spec, 256, knobs, load_machine(data, num_gpus=processes))
        assert work.forward["elementwise"] + work.backward["elementwise"] == pytest.approx(measured * processes)


def test_the_cpu_measurements_are_cached_by_what_would_change_them(monkeypatch, tmp_path):
    calls = fake_cpu_measurements(monkeypatch, tmp_path)
    assert hwprofiles.this_cpu() is None
    first = this_cpu_profile(PRESETS["tiny"], 256, (1,), say=lambda line: None)
    measured = dict(calls)
    assert measured["base"] == 1 and measured["linear"] > 0 and hwprofiles.this_cpu() is not None
    assert this_cpu_profile(PRESETS["tiny"], 256, (1,), say=lambda line: None) == first
    assert calls == measured  # the second plan measures nothing
    this_cpu_profile(PRESETS["tiny"], 256, (1, 2), say=lambda line: None)
    assert calls["linear"] > measured["linear"]  # only the new shapes
    assert calls["attention"] == measured["attention"] + 2  # one new shape, two passes
    assert calls["elementwise"] == measured["elementwise"] + 2
    assert calls["base"] == 2  # the peak, timed again with them (the best is kept: below)
    assert calls["host"] == 1  # the training loop's host time: once for these threads
    key = {**hwprofiles.cpu_key(), "torch": "9.9.9"}
    monkeypatch.setattr(hwprofiles, "cpu_key", lambda threads=None: key)
    assert hwprofiles.this_cpu() is None
    this_cpu_profile(PRESETS["tiny"], 256, (1,), say=lambda line: None)
    assert calls["base"] == 3 and hwprofiles.this_cpu().key == key  # a changed key measures again


def test_the_cpu_peak_is_the_best_rate_ever_measured(monkeypatch, tmp_path):
    """REVIEW: MFU of 137% predicted and 110-143% measured on a CPU whose peak was measured once, under load. The peak
    is the best rate of any GEMM measured here, and a later measurement at a quieter time raises it; so no measured
    efficiency exceeds 1."""
    fake_cpu_measurements(monkeypatch, tmp_path)
    peaks = iter([0.25 * FAKE_PEAK, FAKE_PEAK, 0.25 * FAKE_PEAK])  # the square GEMMs under load, idle, loaded

    def base():
        return hwprofiles.CpuMeasurements(key=hwprofiles.cpu_key(), date="2026-12-02",
                                          peak_fp32_flops_per_s=next(peaks), memory_bytes_per_s=FAKE_BANDWIDTH)
    monkeypatch.setattr(profile_module, "_measure_cpu_base", base)
    loaded = load_machine(this_cpu_profile(PRESETS["tiny"], 256, (16,), say=lambda line: None))
    # The layers ran at up to 0.4 x FAKE_PEAK (a little less for the 20 µs): above the square GEMMs' 0.25.
    assert 0.35 * FAKE_PEAK < loaded.gpu.peak_flops["fp32"] < 0.4 * FAKE_PEAK
    assert max(loaded.gpu.gemm_shapes.values()) == 1.0 and hwprofiles.peak_flops("cpu", "fp32") == \
        loaded.gpu.peak_flops["fp32"]
    idle = load_machine(this_cpu_profile(PRESETS["tiny"], 256, (1, 16), say=lambda line: None))
    assert idle.gpu.peak_flops["fp32"] == FAKE_PEAK and max(idle.gpu.gemm_shapes.values()) <= 0.4
    this_cpu_profile(PRESETS["tiny"], 256, (1, 2, 16), say=lambda line: None)  # measured under load again: kept
    assert hwprofiles.this_cpu().peak_fp32_flops_per_s == FAKE_PEAK


def test_a_share_of_the_threads_is_measured_for_several_processes(monkeypatch, tmp_path):
    """Each of N CPU processes trains with 1/N of the threads: its GEMMs are measured so, and priced against 1/N of
    the peak (here one thread runs at 80% of its share, all four at 40% of the peak); the peak counts them N times."""
    fake_cpu_measurements(monkeypatch, tmp_path, one_thread_efficiency=0.8)
    alone = load_machine(this_cpu_profile(PRESETS["tiny"], 256, (4,), say=lambda line: None))
    four = load_machine(this_cpu_profile(PRESETS["tiny"], 256, (4,), say=lambda line: None, processes=4),
                        num_gpus=4)
    assert four.gpu.peak_flops["fp32"] == alone.gpu.peak_flops["fp32"] / 4 == FAKE_PEAK / 4
    shape = max(alone.gpu.gemm_shapes)
    assert alone.gpu.gemm_shapes[shape] == pytest.approx(0.4, rel=0.05)
    assert four.gpu.gemm_shapes[shape] == pytest.approx(0.8, rel=0.05)
    keys = hwprofiles.this_cpu().linear_seconds  # by shape, with "@1" where measured with one thread
    assert {k.removesuffix("@1") for k in keys if k.endswith("@1")} == {k for k in keys if "@" not in k}


def test_a_long_sequence_is_measured_shorter_with_progress(monkeypatch, tmp_path):
    """REVIEW: `fastml plan --seq 100000` timed attention at the full length, for over 5 minutes, saying nothing.
    Attention is timed at a length of at most MAX_MEASURED_FLOPS (its rate levels off), and a measurement longer than
    a second says how far it is."""
    from fastml.hwprofiles.profile import MAX_MEASURED_FLOPS, attention_shapes

    spec = PRESETS["tiny"]
    (shape,) = attention_shapes(spec, 100_000, (1, 2))
    assert shape[0] == 1 and 100_000 / 64 <= shape[1] < 100_000 / 16
    assert 3.5 * 2 * shape[1] ** 2 * spec.q_size <= MAX_MEASURED_FLOPS
    fake_cpu_measurements(monkeypatch, tmp_path)
    clock = iter(range(1000))  # a second per reading
    monkeypatch.setattr(profile_module.time, "perf_counter", lambda: next(clock))
    lines = []
    this_cpu_profile(spec, 100_000, (1,), say=lines.append)
    progress = [line for line in lines if " timings done " in line]
    assert progress and progress[0].startswith("measuring this CPU: ")


def test_a_broken_cpu_cache_is_one_line(monkeypatch, tmp_path):
    fake_cpu_measurements(monkeypatch, tmp_path)
    path = hwprofiles.cpu_cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": {}, "date": "x", "peak_fp32_flops_per_s": 1.0}))
    with pytest.raises(UserError, match="memory_bytes_per_s: missing required key.*delete the file") as info:
        hwprofiles.this_cpu()
    assert "\n" not in str(info.value)


def test_measuring_this_cpu_for_real(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTML_CACHE", str(tmp_path))
    lines = []
    measured = measure_cpu([(64, 96, 128)], [(1, 64, 4, 2, 16)], [(64, 32, 4, 2, 16, 48)], say=lines.append)
    assert measured.peak_fp32_flops_per_s > 1e8 and measured.memory_bytes_per_s > 1e8
    assert measured.linear_seconds["64,96,128"] > 0 and measured.attention_seconds["1,64,4,2,16"] > 0
    assert measured.elementwise_seconds["64,32,4,2,16,48"] > 0  # heads x head_dim need not be the hidden size
    host = measured.host_overhead[str(torch.get_num_threads())]  # the training loop, narrowed: hwprofiles/host.py
    assert 0 < host["block_pass_s"] < 1 and set(host) == {"step_s", "optimizer_per_block_s", "head_s", "block_pass_s"}
    assert "measuring this CPU" in lines[0]
    assert hwprofiles.this_cpu() == measured


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d["gpu"].pop("hbm_bytes_per_s"), "h200.gpu.hbm_bytes_per_s: missing required key"),
    (lambda d: d["gpu"].update(hbm_bandwith=1e12), "h200.gpu.hbm_bandwith: unknown key"),
    (lambda d: d["node"].update(gpus_per_node="8"), "h200.node.gpus_per_node: expected int"),
    (lambda d: d.update(device="tpu"), "h200.device: 'tpu' is not allowed"),
])
def test_profiles_load_through_from_dict(tmp_path, edit, fragment):
    """Before, a missing rate read as 0 and a misspelled key was ignored."""
    data = json.loads(json.dumps(hwprofiles.load("h200")))
    edit(data)
    with pytest.raises(UserError) as info:
        load_machine(data)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_an_alpha_beta_fit_recovers_latency_and_bus_bandwidth():
    from fastml.hwprofiles.between_gpus import SIZES, bus_bytes, fit_alpha_beta, profile_fields

    def measured(alpha, bandwidth):
        return {kind: {s: alpha + bus_bytes(kind, s, 4) / bandwidth for s in SIZES} for kind in
                ("reduce_scatter", "all_gather", "all_reduce")}
    alpha, bandwidth = fit_alpha_beta(measured(2e-5, 3e11)["all_reduce"], "all_reduce", 4)
    assert alpha == pytest.approx(2e-5, rel=1e-3) and bandwidth == pytest.approx(3e11, rel=1e-3)
    fields = profile_fields({"torch": measured(3e-5, 2e11), "memcpy": measured(1e-4, 4e10)}, 4, p2p=False)
    assert fields["collectives.latency_s"] == pytest.approx(3e-5, rel=1e-3)
    assert fields["collectives.bus_bytes_per_s"]["all_gather"] == pytest.approx(2e11, rel=1e-3)
    assert fields["collectives.host_routed_bus_bytes_per_s"] == pytest.approx(2e11, rel=1e-3)  # no P2P: via host
    assert fields["collectives_fit"]["memcpy"]["reduce_scatter"]["bus_bytes_per_s"] == pytest.approx(4e10, rel=1e-3)
    assert "collectives.host_routed_bus_bytes_per_s" not in profile_fields({"torch": measured(3e-5, 2e11)}, 4, True)


def test_collectives_are_timed_in_one_worker_per_rank():
    """The workers `fastml profile` starts on a machine of several GPUs, here as CPU processes over gloo: every
    transport, kind and size is timed (how fast is the benchmark's business, not a test's)."""
    from fastml.hwprofiles.between_gpus import time_collectives

    seconds = time_collectives("cpu", 2, sizes=(2**12, 2**22), repeats=2)
    assert set(seconds) == {"torch", "memcpy"}
    for kinds in seconds.values():
        assert set(kinds) == {"reduce_scatter", "all_gather", "all_reduce"}
        assert all(set(by_size) == {2**12, 2**22} and all(0 < s < 60 for s in by_size.values())
                   for by_size in kinds.values())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_profile_measures_between_gpus(tmp_path, monkeypatch):
    """`fastml profile --quick` on several GPUs: NCCL's α-β fit and bus bandwidths, the memcpy collectives' and,
    with P2P, the peer copy rate, written over the base profile."""
    monkeypatch.setenv("FASTML_CACHE", str(tmp_path))
    data = profile(str(tmp_path / "hw.json"), Console(file=io.StringIO()), quick=True)
    measured = data["measured"]
    assert 0 < data["collectives"]["latency_s"] == measured["collectives.latency_s"] < 1e-2
    assert all(1e9 < b == data["collectives"]["bus_bytes_per_s"][k]
               for k, b in measured["collectives.bus_bytes_per_s"].items())
    assert set(measured["collectives_fit"]) == {"torch", "memcpy"}
    if torch.cuda.can_device_access_peer(0, 1):
        assert measured["p2p_bytes_per_s"] > 1e9


def test_the_cpu_profiles_adam_bytes_are_the_planners():
    """The CPU profile turns its memory bandwidth into an AdamW rate with the bytes the planner counts for a CPU plan."""
    from fastml.hwprofiles.profile import ADAM_BYTES_PER_PARAM
    from fastml.plan import Knobs
    from fastml.planner.costs import optimizer_step_bytes

    assert ADAM_BYTES_PER_PARAM == optimizer_step_bytes(Knobs(param_dtype="fp32", matmul_dtype="fp32"))
