"""Kills a real training stack from outside at a random moment and checks its resume.

Issue 44: a failure arrives at any moment (mid-forward, inside a collective, during the
snapshot copy or a flush, on any rank), and the survivors then run their own exception paths
(torchtitan's ``main()`` calls ``trainer.close()`` in its ``except``). A trial:

1. runs the stack under ``cudasnap run --max-restarts K -- <its command>`` (a multi-rank
   stack: ``torchrun --max-restarts=0`` inside), reading the per-step lines every stack
   script prints (``[stack] rank=R step=S t=<time>``; ``[stack] rank=R start=S pid=P`` before
   the first step a process trains: the victims are those processes, never a warm standby
   ``cudasnap run`` keeps ready for the next attempt);
2. once step ``kill_after`` is logged, waits a random share of a step's time and SIGKILLs
   the victim worker(s) from outside (one rank, or every rank);
3. lets ``cudasnap run`` restart the job to its end, then compares each rank's final dump
   (``STACK_DUMP``/``TT_DUMP``: ``torch.save({"tensors", "info"})``) with an uninterrupted
   reference run of the same stack: every tensor ``torch.equal``, every info value equal.

A trial's record: the stack, the victim, the newest step logged before the kill, where in
the step the kill fell (share of a step's time), the step the job resumed at, the steps
replayed (steps logged before the kill that were trained again), bitwise or not (and what
differs), the seconds from the kill to the first resumed step, the exit status.

Stacks (``STACKS``): torchtitan's llama3 debug model on 2 CPU ranks over gloo with FSDP2,
tensor parallel or pipeline parallel (tools/stacks/titan_cpu.py, the README's config in
tools/stacks/titan_cfg.py, attention dropout on, a committed interval flush every 2 steps),
a Hugging Face Trainer, single process and DDP on 2 ranks (tools/stacks/hf_train.py), and the
README's quick start (tools/stacks/quickstart_train.py); issue 45's tensor-subclass optimizer
state: the quick start with torchao's AdamW8bit / AdamW4bit / AdamWFp8 and the HF Trainer
fine-tuning a PEFT LoRA (rank 32) with ``optim="adamw_torch_8bit"``.
Used by tests/e2e/test_kill_real_stacks.py (a few trials) and bench/kill_matrix.py (many).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TITAN_SITE = REPO / "build" / "titan-site"
STEP_RE = re.compile(r"\[stack\] rank=(\d+) step=(\d+) t=([\d.]+)")
START_RE = re.compile(r"\[stack\] rank=(\d+) start=(\d+)")
PID_RE = re.compile(r"\[stack\] rank=(\d+) start=\d+ pid=(\d+)")


@dataclass(frozen=True)
class Stack:
    """One training stack the harness runs: its commands, ranks and steps."""

    name: str
    ranks: int
    steps: int
    script: str  # the worker script's file name (finds the victims' pids)
    ref: Callable[[Path], list[str]]  # the uninterrupted reference's command
    cmd: Callable[[Path], list[str]]  # the command under cudasnap run
    dump_var: str  # the variable naming the dump prefix
    env: Callable[[Path], dict[str, str]] = field(default=lambda _w: {})
    needs: tuple[str, ...] = ()  # optional packages it imports (requirements-extras.txt)

    def available(self) -> str | None:
        """Why this stack cannot run here, or None."""
        import importlib.util

        missing = [m for m in self.needs if importlib.util.find_spec(m) is None]
        if missing:
            return f"{', '.join(missing)} not installed (requirements-extras.txt)"
        if self.name.startswith("titan") and not (TITAN_SITE / "torchtitan").is_dir():
            return f"torchtitan is not installed in {TITAN_SITE} (make titan)"
        if self.name.startswith("hf"):
            try:
                import accelerate  # noqa: F401
                import transformers  # noqa: F401
            except ImportError as e:
                return f"Hugging Face transformers/accelerate are not installed: {e}"
        return None


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={n}", "--max-restarts=0", "--monitor-interval=0.1"]


TITAN_STEPS = 6
_TITAN_PAR = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp": ["--parallelism.data_parallel_shard_degree", "1",
           "--parallelism.tensor_parallel_degree", "2"],
    "pp": ["--parallelism.data_parallel_shard_degree", "1",
           "--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"],
}


def _titan(par: str, config: tuple[str, str], work: Path, extra: list[str]) -> list[str]:
    assets = work.parent / "titan-assets"
    return [*_torchrun(2), str(REPO / "tools/stacks/titan_cpu.py"), "--module", config[0],
            "--config", config[1], "--hf_assets_path", str(assets / "tokenizer"),
            "--dataloader.dataset_path", str(assets / "c4_test"),
            "--dump_folder", str(work / "out"), *_TITAN_PAR[par],
            "--training.steps", str(TITAN_STEPS), "--debug.seed", "42", "--debug.deterministic",
            "--training.mixed_precision_param", "float32", "--training.seq_len", "128",
            "--training.local_batch_size", "2", "--metrics.log_freq", "1", *extra]


def _titan_env(work: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(TITAN_SITE), str(REPO)]),
            "HF_HOME": str(work / "hf"), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
            "TT_ATTN_DROPOUT": "0.1"}


def titan_stack(par: str) -> Stack:
    return Stack(
        name=f"titan-{par}", ranks=2, steps=TITAN_STEPS, script="titan_cpu.py",
        ref=lambda w: _titan(par, ("llama3", "llama3_debugmodel"), w, []),
        cmd=lambda w: _titan(par, ("tools.stacks.titan_cfg", "llama3_debugmodel_cudasnap"), w,
                             ["--checkpoint.interval", "2"]),
        dump_var="TT_DUMP", env=_titan_env)


HF_STEPS = 30


def _hf(n: int, work: Path, ref: bool, extra: tuple[str, ...] = ()) -> list[str]:
    script = [str(REPO / "tools/stacks/hf_train.py"), "--steps", str(HF_STEPS), *extra]
    script += ["--ref"] if ref else ["--dir", str(work / "ckpt")]
    return [*_torchrun(n), *script] if n > 1 else [sys.executable, *script]


def hf_stack(n: int) -> Stack:
    return Stack(name="hf-ddp" if n > 1 else "hf-single", ranks=n, steps=HF_STEPS,
                 script="hf_train.py", ref=lambda w: _hf(n, w, True),
                 cmd=lambda w: _hf(n, w, False), dump_var="STACK_DUMP")


HF_LORA_8BIT = ("--lora", "32", "--optim", "adamw_torch_8bit")


def hf_lora_8bit_stack() -> Stack:
    """The HF Trainer fine-tuning a PEFT LoRA of rank 32 with ``optim="adamw_torch_8bit"``
    (torchao's AdamW8bit: the state of lora_B of c_attn/c_fc, 6,144 and 8,192 elements, is
    an OptimState8bit; the smaller ones plain), single process."""
    return Stack(name="hf-lora-8bit", ranks=1, steps=HF_STEPS, script="hf_train.py",
                 ref=lambda w: _hf(1, w, True, HF_LORA_8BIT),
                 cmd=lambda w: _hf(1, w, False, HF_LORA_8BIT), dump_var="STACK_DUMP",
                 needs=("torchao", "peft"))


QUICK_STEPS = 300


def quickstart_stack(optim: str = "adamw") -> Stack:
    """The README's quick start; ``optim``: its AdamW, or torchao's low-bit ``adamw8bit`` /
    ``adamw4bit`` / ``adamwfp8`` (tensor-subclass optimizer state, issue 45)."""
    script = str(REPO / "tools/stacks/quickstart_train.py")
    args = ["--steps", str(QUICK_STEPS), "--optim", optim]
    return Stack(name="quickstart" if optim == "adamw" else f"torchao-{optim[5:]}", ranks=1,
                 steps=QUICK_STEPS, script="quickstart_train.py",
                 ref=lambda w: [sys.executable, script, "--ref", *args],
                 cmd=lambda w: [sys.executable, script, *args], dump_var="STACK_DUMP",
                 needs=() if optim == "adamw" else ("torchao",))


STACKS: dict[str, Callable[[], Stack]] = {
    "titan-fsdp2": lambda: titan_stack("fsdp2"), "titan-tp": lambda: titan_stack("tp"),
    "titan-pp": lambda: titan_stack("pp"), "hf-single": lambda: hf_stack(1),
    "hf-ddp": lambda: hf_stack(2), "quickstart": quickstart_stack,
    "torchao-8bit": lambda: quickstart_stack("adamw8bit"),
    "torchao-4bit": lambda: quickstart_stack("adamw4bit"),
    "torchao-fp8": lambda: quickstart_stack("adamwfp8"), "hf-lora-8bit": hf_lora_8bit_stack,
}


@dataclass
class Result:
    """One trial (module docstring)."""

    stack: str
    victim: str  # "rank0", "rank1", ..., "all"
    kill_after: int  # the step whose log line started the countdown
    killed_at_step: int | None = None  # the newest step logged before the kill
    phase: float | None = None  # where in the step the kill fell: share of a step's time
    resumed_at: int | None = None  # the first step the restarted job trained
    replayed: int | None = None  # steps logged before the kill and trained again
    bitwise: bool = False
    differ: list[str] = field(default_factory=list)
    kill_to_resumed_s: float | None = None
    rc: int | None = None
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return (self.error is None and self.rc == 0 and self.bitwise and
                self.replayed is not None and 0 <= self.replayed <= 1)


def setup(work: Path) -> None:
    """The shared inputs of the stacks under ``work`` (torchtitan's tokenizer and data)."""
    assets = work / "titan-assets"
    if not (assets / "c4_test").is_dir() and (TITAN_SITE / "torchtitan").is_dir():
        from tools.stacks.titan_assets import make

        make(assets)


def _base_env(job: str) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("CUDASNAP_HEALTH", "CUDASNAP_DIR", "CUDASNAP_FRESH", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    env.update({"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDASNAP_JOB": job,
                "TOKENIZERS_PARALLELISM": "false"})
    return env


def _children() -> dict[int, int]:
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return parent


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (torchrun's workers run in sessions of their own,
    so a process group kill misses them)."""
    parent = _children()
    out, todo = [], [root]
    while todo:
        cur = todo.pop()
        kids = [c for c, pp in parent.items() if pp == cur]
        out += kids
        todo += kids
    return out


def workers(root: int, script: str) -> dict[int, int]:
    """{rank: pid} of the live worker processes running ``script`` under ``root``."""
    out: dict[int, int] = {}
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if not any(a.endswith(script.encode()) for a in cmd):
                continue
            env = dict(kv.split(b"=", 1) for kv in
                       Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
            if b"torch.distributed.run" in b" ".join(cmd):
                continue  # torchrun itself, not a worker
            out[int(env.get(b"RANK", b"0"))] = pid
    return out


def _kill_tree(root: int) -> None:
    for pid in [root, *descendants(root)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _remove_arenas(job: str) -> None:
    shm = Path(os.environ.get("CUDASNAP_SHM_DIR", "/dev/shm"))
    for p in shm.glob(f"cudasnap-{job}*"):
        p.unlink(missing_ok=True)


def run_reference(stack: Stack, work: Path, timeout: float = 600) -> tuple[Path, str]:
    """The uninterrupted run (no cudasnap): its dump prefix and log."""
    ref = work / f"ref-{stack.name}"
    ref.mkdir(parents=True, exist_ok=True)
    prefix = ref / "dump"
    env = {**_base_env(f"ref{uuid.uuid4().hex[:6]}"), **stack.env(ref),
           stack.dump_var: str(prefix)}
    p = subprocess.run(stack.ref(ref), env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"{stack.name}: the reference run failed (rc {p.returncode}):\n"
                           f"{p.stdout[-4000:]}")
    return prefix, p.stdout


def compare(stack: Stack, ref: Path, got: Path) -> list[str]:
    """What differs between two runs' final dumps (empty: bitwise)."""
    import torch

    differ: list[str] = []
    for rank in range(stack.ranks):
        fa, fb = Path(f"{ref}.rank{rank}.pt"), Path(f"{got}.rank{rank}.pt")
        if not fb.exists():
            return [f"rank {rank}: no final dump"]
        a, b = (torch.load(f, weights_only=False) for f in (fa, fb))
        if a["tensors"].keys() != b["tensors"].keys():
            differ.append(f"rank {rank}: tensor keys differ")
            continue
        differ += [f"rank {rank}: {k}" for k in a["tensors"]
                   if not torch.equal(a["tensors"][k], b["tensors"][k])]
        differ += [f"rank {rank}: info.{k}" for k in sorted(set(a["info"]) | set(b["info"]))
                   if a["info"].get(k) != b["info"].get(k)]
    return differ


def trial(stack: Stack, ref: Path, work: Path, *, victim: str, kill_after: int,
          delay_frac: float, restarts: int = 3, timeout: float = 600) -> Result:
    """One kill: ``victim`` ("rank<R>" or "all") is SIGKILLed ``delay_frac`` of a step's
    time after step ``kill_after`` is logged (module docstring)."""
    job = f"k{uuid.uuid4().hex[:8]}"
    tdir = work / f"{stack.name}-{job}"
    tdir.mkdir(parents=True)
    res = Result(stack=stack.name, victim=victim, kill_after=kill_after)
    env = {**_base_env(job), **stack.env(tdir), stack.dump_var: str(tdir / "dump")}
    cmd = [sys.executable, "-m", "cudasnap", "run", "--dir", str(tdir / "ckpt"),
           "--max-restarts", str(restarts), "--", *stack.cmd(tdir)]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, cwd=REPO, start_new_session=True)
    lines: list[str] = []
    steps: list[tuple[int, int, float]] = []  # (rank, step, time) in log order
    training: dict[int, int] = {}  # rank -> pid of the process that trains it now
    armed = threading.Event()

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line)
            mp = PID_RE.search(line)
            if mp:
                training[int(mp.group(1))] = int(mp.group(2))
            m = STEP_RE.search(line)
            if m:
                steps.append((int(m.group(1)), int(m.group(2)), float(m.group(3))))
                if int(m.group(2)) >= kill_after:
                    armed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed_t = None
    try:
        if not armed.wait(timeout):
            raise TimeoutError(f"step {kill_after} was never logged")
        times = sorted({t for _, _, t in steps})
        gaps = [b - a for a, b in zip(times, times[1:]) if b > a] or [1.0]
        step_s = sorted(gaps)[len(gaps) // 2]
        time.sleep(delay_frac * step_s)
        pids = dict(training) or workers(p.pid, stack.script)
        targets = list(pids.values()) if victim == "all" else \
            [pids[int(victim[4:])]] if int(victim[4:]) in pids else []
        if not targets:
            raise RuntimeError(f"no live worker to kill for {victim} (found {pids})")
        for pid in targets:
            os.kill(pid, signal.SIGKILL)
        killed_t = time.time()
        before = [(r, s, t) for r, s, t in steps if t <= killed_t]
        res.killed_at_step = max((s for _, s, _ in before), default=0)
        last_t = max((t for _, _, t in before), default=killed_t)
        res.phase = round(min(1.0, (killed_t - last_t) / step_s), 3)
        p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except (subprocess.TimeoutExpired, TimeoutError, RuntimeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        if p.poll() is None:
            _kill_tree(p.pid)
            p.wait(timeout=60)
        reader.join(timeout=30)
        _remove_arenas(job)
    res.rc, res.seconds = p.returncode, round(time.monotonic() - t0, 1)
    log = "".join(lines)
    (tdir / "run.log").write_text(log)
    if killed_t is not None:
        after = log[log.find("[stack]", 0):]
        starts = [(int(r), int(s)) for r, s in START_RE.findall(after)]
        # the starts of the restarted attempt(s): every start line after the first attempt's
        restarted = starts[stack.ranks:] if len(starts) > stack.ranks else []
        if restarted:
            res.resumed_at = min(s for _, s in restarted[-stack.ranks:])
            res.replayed = res.killed_at_step - (res.resumed_at - 1) \
                if res.killed_at_step is not None else None
            first = [t for _, s, t in steps if s == res.resumed_at and t > killed_t]
            if first:
                res.kill_to_resumed_s = round(min(first) - killed_t, 2)
    if res.error is None and res.rc == 0:
        res.differ = compare(stack, ref, tdir / "dump")
        res.bitwise = not res.differ
    elif res.error is None:
        res.error = f"exit status {res.rc}: " + log[-1500:]
    if res.ok:
        import shutil

        shutil.rmtree(tdir, ignore_errors=True)
    return res


def random_trial(stack: Stack, ref: Path, work: Path, rng: random.Random,
                 victims: tuple[str, ...] | None = None) -> Result:
    """A trial at a random step, a random moment in it, a random victim."""
    choices = victims or (*(f"rank{r}" for r in range(stack.ranks)), "all") \
        if stack.ranks > 1 else ("rank0",)
    return trial(stack, ref, work, victim=rng.choice(choices),
                 kill_after=rng.randint(1, stack.steps - 2), delay_frac=rng.random())


def table(results: list[Result]) -> str:
    """A markdown table of the trials."""
    rows = ["| stack | victim | killed after step | phase | resumed at | replayed | bitwise "
            "| kill -> resumed step (s) | ok |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.stack} | {r.victim} | {r.killed_at_step} | {r.phase} | "
                    f"{r.resumed_at} | {r.replayed} | {r.bitwise} | {r.kill_to_resumed_s} | "
                    f"{'yes' if r.ok else 'NO: ' + (r.error or ', '.join(r.differ[:3]))[:200]} |")
    return "\n".join(rows)


def as_json(results: list[Result]) -> list[dict[str, object]]:
    return [{**asdict(r), "ok": r.ok} for r in results]


if __name__ == "__main__":  # one trial, for a look: python -m tools.stacks.killer STACK
    name = sys.argv[1] if len(sys.argv) > 1 else "titan-fsdp2"
    w = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(f"/tmp/killer-{os.getpid()}")
    w.mkdir(parents=True, exist_ok=True)
    setup(w)
    st = STACKS[name]()
    r_prefix, _ = run_reference(st, w)
    print(json.dumps(as_json([random_trial(st, r_prefix, w, random.Random())]), indent=1))
