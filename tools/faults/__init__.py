"""The fault matrix and what it stands on (bench/faults.py runs all of it, tests/e2e/test_faults.py
a bounded part): ``matrix`` (the disk, shm, kill, diskfull, shmfull, lock, dist and export
families, ``Case`` and the table), ``supervisor`` and ``endjob`` (the families around
``cudasnap run`` and the end of a multi-rank job), the processes they start
(``fault_worker``, ``run_trainer``, the warm ``zygote`` fork server), the training job they
restore bitwise (``trainlib``) and the staging arena's byte layout they damage (``layout``).

Built on the package alone, never on tests/ (tests/arch/test_bench_on_package.py); the tests
import from here."""
