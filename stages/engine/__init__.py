"""The Engine stage: ``core/`` (engine, scheduler, block manager, request, sampler, structured
outputs; no Ray, and no torch in the scheduler and block manager), ``runner/`` (model runner,
models, kernels, attention, weight loading and quantisation), ``driver/`` (the step loop and how it
runs: in process or in a child process), and the Serve adapter in :mod:`.deployment`, the only
module here that imports Ray."""

import os

# Set before torch and the CPU kernels load their OpenMP runtimes (this package is imported first in
# an Engine replica): a worker thread that finished its part of a parallel op spins this many times
# before it sleeps, where GNU's default is 300,000 (~0.1-1 ms). A step with ``engine.prefill_threads``
# runs hundreds of short parallel ops with Python between them; at the default its worker would
# keep the second core busy through the whole step, and the CPU stages need that core in the gaps
# to bring in the rest of a burst. At this count a 2-thread step is as fast as at the default. A
# value set in the environment wins.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")
