"""Failure-rate presets: public per-GPU failure rates of large training jobs.

* Llama 3 405B pre-training (Meta, "The Llama 3 Herd of Models", 2024, §3.3.4):
  16,384 H100 GPUs, 419 unexpected interruptions in a 54-day snapshot.
  Job MTBF = 54 * 24 h / 419 = 1296 / 419 = 3.093 h; per-GPU MTBF
  = 16,384 * 3.093 h = 50,677 h (5.8 years); lambda = 1.973e-5 per GPU-hour.
  All unexpected interruptions are charged to the GPUs (GPU and HBM faults are
  about 59% of them; the rest, e.g. network, host, software, also scale with
  the job's size), so this is a per-GPU-slot rate.
* Meta research clusters (Kokolis et al., "Revisiting Reliability in Large-Scale
  Machine Learning Research Clusters", arXiv:2410.21680, 2024 / HPCA 2025):
  job MTTF 7.9 h for 1,024-GPU jobs (A100).  Per-GPU MTBF = 1,024 * 7.9 h
  = 8,089.6 h; lambda = 1.236e-4 per GPU-hour (about 6x the Llama 3 rate).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FailurePreset", "LLAMA3_405B", "KOKOLIS_RSC_1024", "PRESETS",
           "LLAMA3_GPU_MTBF_HOURS", "KOKOLIS_GPU_MTBF_HOURS"]


@dataclass(frozen=True)
class FailurePreset:
    """An observed failure rate: ``interruptions`` in ``observed_hours`` at ``gpus``."""

    name: str
    gpus: int
    observed_hours: float
    interruptions: float
    source: str

    @property
    def job_mtbf_hours(self) -> float:
        return self.observed_hours / self.interruptions

    @property
    def gpu_mtbf_hours(self) -> float:
        return self.gpus * self.job_mtbf_hours

    @property
    def gpu_failure_rate_per_hour(self) -> float:
        return 1.0 / self.gpu_mtbf_hours


LLAMA3_405B = FailurePreset(
    name="llama3",
    gpus=16_384,
    observed_hours=54 * 24.0,  # 54-day snapshot = 1296 h
    interruptions=419,  # unexpected interruptions
    source='Meta, "The Llama 3 Herd of Models", 2024: 419 unexpected '
    "interruptions in 54 days on 16,384 H100 GPUs",
)
LLAMA3_GPU_MTBF_HOURS: float = 16_384 * 54 * 24.0 / 419  # = 50,677 h per GPU

KOKOLIS_RSC_1024 = FailurePreset(
    name="kokolis",
    gpus=1_024,
    observed_hours=7.9,  # job MTTF of a 1,024-GPU job
    interruptions=1,
    source='Kokolis et al., "Revisiting Reliability in Large-Scale Machine '
    'Learning Research Clusters", 2024/2025: job MTTF 7.9 h at 1,024 GPUs',
)
KOKOLIS_GPU_MTBF_HOURS: float = 1_024 * 7.9  # = 8,089.6 h per GPU

PRESETS: dict[str, FailurePreset] = {p.name: p for p in (LLAMA3_405B, KOKOLIS_RSC_1024)}
