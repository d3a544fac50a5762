"""Race-audit specimens: small kernels with planted mutants that the static audit and the GPU race
checks are tested on (tests/test_race_static.py, tests/test_race_cli.py, scripts/race_gpu.py).
Not shipped kernels; declared in kernels/manifest.toml so that the build and `fasttrack audit` take them.
`mutants.py` holds the planted mutants of shipped kernels (subclasses overriding one seam of the
shipped op), so that the shipped modules carry no mutant code."""
