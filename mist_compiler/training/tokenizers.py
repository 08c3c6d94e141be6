"""Loading a Hugging Face tokenizer by name without minutes of retries when there is no network.

``AutoTokenizer.from_pretrained(name)`` retries the hub five times with back-off before it says it
cannot connect (about a minute). :func:`load_tokenizer` tries, in order: a local directory, the
local Hugging Face cache (``local_files_only``), then one short request to the hub endpoint
(``HF_ENDPOINT``, proxies honoured) before the real download; without a network the error comes in
seconds and says where the tokenizer could have come from.
"""
from __future__ import annotations

import functools
import os
import urllib.error
import urllib.request
from typing import Any

PROBE_TIMEOUT_S = 5.0


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; the message names it and says why."""


def _hub_unreachable(endpoint: str) -> str | None:
    """None when ``endpoint`` answers an HTTP request within the probe timeout; else why not."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as error:
        return str(getattr(error, "reason", error))
    return None


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str) -> Any:
    """The tokenizer ``name`` (a directory or a hub name); a :class:`TokenizerError` in seconds otherwise."""
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise TokenizerError("--tokenizer needs the transformers package (pip install transformers)") from error
    if os.path.isdir(name):
        try:
            return AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as error:
            raise TokenizerError(f"--tokenizer {name}: the directory holds no loadable tokenizer ({error})") from error
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        pass  # not in the cache
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise TokenizerError(f"--tokenizer {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    why = _hub_unreachable(endpoint)
    if why is not None:
        raise TokenizerError(f"--tokenizer {name!r} is not a local directory nor in the Hugging Face cache, and "
                             f"{endpoint} cannot be reached ({why}); download it where there is a network, or "
                             f"pass its directory")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise TokenizerError(f"--tokenizer {name!r} cannot be loaded: {str(error).splitlines()[0]}") from error
