"""The training run: build (engine from a config), train (the loop), its log lines, resume, run folder, progress line,
memory check, launcher and signals, start-up guard, rank supervisor, faults, TensorBoard files, the trace.
Import its modules by name (hpengine.run.train, ...): this package imports nothing itself, so that
run.startguard can be armed before any module starts MPI."""
