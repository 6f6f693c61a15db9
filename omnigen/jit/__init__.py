"""Just-in-time building: `codegen` renders sources (pure), `toolchain` runs nvcc and ninja (the only
subprocesses), `cache` owns the cache directory (the only writer), `regenerate` refreshes generated/."""
