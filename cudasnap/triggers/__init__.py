"""Triggers: every reason to flush a snapshot, and what to do about it.

One room per mechanism:

* :mod:`.kinds`       the :class:`Trigger` type and Xid classes
* :mod:`.policy`      trigger kind -> action and exit code (``CUDASNAP_POLICY``)
* :mod:`.dispatch`    :class:`Dispatcher`: applies the policy, one flush at a time
* :mod:`.signals`     SIGTERM/SIGUSR1 through the C self-pipe to one thread (the only signal path)
* :mod:`.watchdog`    no step boundary for ``timeout_s`` -> "hang"
* :mod:`.hooks`       uncaught exceptions (sys/threading excepthook)
* :mod:`.nvml`        the NVML session: one lock, one query table, ``read_gpu_status``
* :mod:`.nvml_source` NVML event + poll threads as trigger source
* :mod:`.inject`      scripted faults (``CUDASNAP_INJECT``)
* :mod:`.monitor`     :class:`HealthMonitor`: NVML or injection
* :mod:`.guard`       :class:`Guard`: all of the above for one flush target

Importing this package never loads the native extension or touches CUDA.
"""
from __future__ import annotations

from .dispatch import Dispatcher, HistoryEntry
from .guard import FlushTarget, Guard
from .hooks import ExceptHooks, install_excepthook
from .inject import ENV_INJECT, InjectedFault, InjectedSource, parse_inject
from .kinds import APPLICATION_XIDS, FATAL_XIDS, TRIGGER_KINDS, Trigger, TriggerCallback, classify_xid
from .monitor import HealthMonitor
from .nvml import read_gpu_status
from .nvml_source import NvmlSource, NvmlWatcher
from .policy import (
    DEFAULT_EXIT_CODES,
    ENV_POLICY,
    EXIT_EXCEPTION,
    EXIT_GPU_FAULT,
    EXIT_GPU_LOST,
    EXIT_HANG,
    EXIT_MANUAL,
    EXIT_PEER_FAILURE,
    EXIT_PREEMPTED,
    POLICY_KEYS,
    Action,
    Policy,
)
from .signals import SignalHandlers, install_signal_handlers
from .watchdog import Watchdog

__all__ = [
    "APPLICATION_XIDS", "DEFAULT_EXIT_CODES", "ENV_INJECT", "ENV_POLICY", "EXIT_EXCEPTION", "EXIT_GPU_FAULT",
    "EXIT_GPU_LOST", "EXIT_HANG", "EXIT_MANUAL", "EXIT_PEER_FAILURE", "EXIT_PREEMPTED", "FATAL_XIDS",
    "POLICY_KEYS", "TRIGGER_KINDS", "Action", "Dispatcher", "ExceptHooks", "FlushTarget", "Guard",
    "HealthMonitor", "HistoryEntry", "InjectedFault", "InjectedSource", "NvmlSource", "NvmlWatcher", "Policy",
    "SignalHandlers", "Trigger", "TriggerCallback", "Watchdog", "classify_xid", "install_excepthook",
    "install_signal_handlers", "parse_inject", "read_gpu_status",
]
