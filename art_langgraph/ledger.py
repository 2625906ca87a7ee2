"""Fetch sampled-token records from the gateway's ledger, many per request.

`POST {base_url}/art/completions/batch {"ids": [...]}` answers `{"data": [records], "missing": [...]}`;
a record is `{"id", "prompt_token_ids", "choices": [{"token_ids", "logprobs", ...}], "step", ...}`.
An endpoint that is not our gateway (no such route) or not reachable gives no records, so the
caller reports those turns as missing, with their model and response id.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from typing import Any

import httpx

from art_core.protocol import LEDGER_PATH

log = logging.getLogger(__name__)

BATCH = 256  # ids per request: keeps a request small whatever the rollout length
TIMEOUT = httpx.Timeout(30.0, connect=5.0)

# One client per thread-safe use (sync) and per event loop (async), reused across rollouts:
# creating an httpx client builds an SSL context, which costs 20-200 ms, more than a model call.
_sync: httpx.Client | None = None
_sync_lock = threading.Lock()
_async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
    weakref.WeakKeyDictionary())


def _sync_client() -> httpx.Client:
    global _sync
    with _sync_lock:
        if _sync is None:
            _sync = httpx.Client(timeout=TIMEOUT)
        return _sync


def _async_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _async.get(loop)
    if client is None:
        client = _async[loop] = httpx.AsyncClient(timeout=TIMEOUT)
    return client


def _request(base_url: str, api_key: str | None) -> tuple[str, dict[str, str]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return f"{base_url.rstrip('/')}{LEDGER_PATH}/batch", headers


def _parse(r: httpx.Response, url: str) -> dict[str, dict[str, Any]]:
    if r.status_code == 401:
        raise PermissionError(f"the ledger at {url} refused the API key (401): pass api_key= "
                              "or set ART_API_KEY")
    if r.status_code != 200:
        log.warning("ledger at %s answered %d: %s", url, r.status_code, r.text[:200])
        return {}
    return {rec["id"]: rec for rec in r.json().get("data", [])}


def fetch_records(base_url: str, ids: list[str], api_key: str | None = None
                  ) -> dict[str, dict[str, Any]]:
    """Ledger records by response id (blocking)."""
    url, headers = _request(base_url, api_key)
    out: dict[str, dict[str, Any]] = {}
    client = _sync_client()
    try:
        for i in range(0, len(ids), BATCH):
            out.update(_parse(client.post(url, json={"ids": ids[i:i + BATCH]},
                                          headers=headers), url))
    except httpx.TransportError as e:
        log.warning("ledger at %s not reachable: %s", url, e)
    return out


async def fetch_records_async(base_url: str, ids: list[str], api_key: str | None = None
                              ) -> dict[str, dict[str, Any]]:
    """Ledger records by response id (async)."""
    url, headers = _request(base_url, api_key)
    out: dict[str, dict[str, Any]] = {}
    client = _async_client()
    try:
        for i in range(0, len(ids), BATCH):
            r = await client.post(url, json={"ids": ids[i:i + BATCH]}, headers=headers)
            out.update(_parse(r, url))
    except httpx.TransportError as e:
        log.warning("ledger at %s not reachable: %s", url, e)
    return out
