"""What a benchmark ran on: the development machines change from day to day (AVX2, VNNI, AMX),
so every run records its CPU and kernel path next to its figures."""

from __future__ import annotations

import platform

import torch

from shm_engine.model import kernels


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    """The CPU, kernel path and thread counts of this process, for a benchmark's JSON."""
    return {
        "cpu": cpu_model(),
        "kernel_path": kernels.get_path(),
        "best_kernel_path": kernels.best_path(),
        "kernel_threads": kernels.get_num_threads(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def describe(info: dict) -> str:
    return (
        f"{info['cpu']}: kernel path={info['kernel_path']} (best {info['best_kernel_path']}), "
        f"threads ours={info['kernel_threads']} torch={info['torch_threads']}, "
        f"torch {info['torch']} cpu capability={info['torch_cpu_capability']}"
    )
