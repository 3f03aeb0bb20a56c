"""agentrl's code sandbox: a standalone service that runs untrusted Python and bash.

POST /run_code speaks SandboxFusion's schema (models.py, server.py); each run is confined by Linux
namespaces, rlimits and cgroups in a child forked from a pre-started, pre-importing zygote (pool.py,
zygote.py, supervisor.py, forker.py, program.py, rootfs.py, cgroups.py); sessions keep Python state across calls (sessions.py); a
Docker backend serves hosts with a Docker engine (docker_backend.py). Start it with `agentrl sandbox serve`
or `python -m sandbox serve` (cli.py). README.md states exactly what is and is not isolated.
Importing this package imports nothing heavy (no torch, no FastAPI): the zygote imports it too.
"""

__version__ = "0.1.0"
