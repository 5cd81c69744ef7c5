"""The engine core: scheduler, paged KV cache, model runner and sampler. No Ray imports here."""

import os

# Set before torch and the CPU kernels load their OpenMP runtimes (this package is imported first in
# an Engine replica): a worker thread that finished its part of a parallel op spins this many times
# before it sleeps, where GNU's default is 300,000 (~0.1-1 ms). A step with ``engine.prefill_threads``
# runs hundreds of short parallel ops with Python between them; at the default its worker would
# keep the second core busy through the whole step, and the CPU stages need that core in the gaps
# to bring in the rest of a burst. Measured in-process, 2 threads: as fast as the default spin
# (OMP_WAIT_POLICY=passive was 1.2x slower). A value set in the environment wins.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")
