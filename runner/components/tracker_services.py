"""Whether a tracker's service can be used, asked before launch in a bounded time: a W&B API key where a run logs
online, an MLflow tracking server that answers."""

from __future__ import annotations

import netrc
import os
import urllib.error
import urllib.request
from typing import Optional
from urllib.parse import urlparse

WAIT_S = 5.0


def wandb_key_known(given: Optional[str]) -> bool:
    """As wandb finds a key: the config's, WANDB_API_KEY, or the netrc entry `wandb login` writes."""
    if given or os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def unanswered(url: str) -> Optional[str]:
    """Why an HTTP(S) endpoint does not answer 200 within WAIT_S seconds, or None when it does."""
    try:
        urllib.request.urlopen(url, timeout=WAIT_S).close()
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code} at {urlparse(url).path}"
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        if "timed out" in str(reason):
            return f"no answer within {WAIT_S:g} s"
        return getattr(reason, "strerror", None) or str(reason)
    return None
