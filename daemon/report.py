"""``tfelastic report``: the job's goodput ledger as a timeline, a line per generation, then the totals. It asks the
job's coordinator, as ``status`` does; with an etcd rendezvous and no coordinator (the job ended, or one is being
elected) it reads the job's state that the coordinators write to etcd, which holds the same ledger."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from tfelastic.daemon.commands import OperatorError, describe_rpc_error, find_coordinator
from tfelastic.daemon.config import OperatorConfig
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.preflight import check_tls_files
from tfelastic.daemon.rendezvous.api import GoodputView
from tfelastic.daemon.rendezvous.durable import DurableState
from tfelastic.daemon.rendezvous.goodput import ledger_of_export
from tfelastic.daemon.status import (
    goodput_json,
    marks_json,
    render_report,
    status_to_json,
    terminal_safe,
    timeline_json,
)
from tfelastic.daemon.timeline import lay_out


def run_report(config: OperatorConfig, token: str | None, *, as_json: bool, html: str | None = None,
               tensorboard: str | None = None) -> int:
    """Prints the report (a table, or JSON); ``html``: also the page to this file (``-``: instead, to standard
    output); ``tensorboard``: also the scalars into this directory. With either, the table is left out."""
    check_tls_files(config.rendezvous.tls)
    try:
        doc = _from_coordinator(config, token)
    except _NoCoordinator as e:
        if config.rendezvous.etcd is None:
            raise OperatorError(str(e)) from None
        doc = _from_etcd(config)
    if as_json:
        print(json.dumps(doc, indent=2, allow_nan=False), flush=True)
    elif html is None and tensorboard is None:
        print(terminal_safe(render_report(doc, doc["generations"])), flush=True)
    if html is not None:
        _write_page(doc, html)
    if tensorboard is not None:
        from tfelastic.daemon.report_tensorboard import write_scalars

        written = write_scalars(lay_out(doc), Path(tensorboard))
        print(f"tfelastic report: wrote TensorBoard scalars to {written}", file=sys.stderr, flush=True)
    return ExitCode.SUCCEEDED


def _write_page(doc: dict[str, Any], destination: str) -> None:
    from tfelastic.daemon.report_page import render_page

    page = render_page(lay_out(doc), doc)
    if destination == "-":
        sys.stdout.write(page)
        sys.stdout.flush()
        return
    path = Path(destination)
    if path.is_dir():
        raise OperatorError(f"report --html {destination}: is a directory; name the page's file")
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(page, encoding="utf-8")
        os.replace(partial, path)  # a reader never sees half a page
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise OperatorError(f"report --html {destination}: cannot write it ({e.strerror})") from None
    print(f"tfelastic report: wrote {path} ({len(page.encode()) // 1024} KiB)", file=sys.stderr, flush=True)


class _NoCoordinator(Exception):
    pass


def _from_coordinator(config: OperatorConfig, token: str | None) -> dict[str, Any]:
    from tfelastic.daemon.rendezvous.client import fetch_status

    rdzv = config.rendezvous
    try:
        endpoint = rdzv.endpoint if isinstance(rdzv.endpoint, Endpoint) else find_coordinator(config)
        snapshot = asyncio.run(fetch_status(endpoint, token, rdzv.tls))
    except OperatorError as e:
        raise _NoCoordinator(str(e)) from None
    except grpc.RpcError as e:
        if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise OperatorError(describe_rpc_error(endpoint, e)) from None
        raise _NoCoordinator(describe_rpc_error(endpoint, e, tls=rdzv.tls.enabled)) from None
    doc = status_to_json(snapshot)
    return {**doc, "source": "coordinator", "generations": timeline_json(snapshot.goodput),
            "marks": marks_json(snapshot.goodput), "at": time.time()}


def _from_etcd(config: OperatorConfig) -> dict[str, Any]:
    from tfelastic.daemon.errors import ConfigError
    from tfelastic.daemon.etcd.client import EtcdClient, EtcdError
    from tfelastic.daemon.etcd.election import BadJobState, Election
    from tfelastic.daemon.preflight import etcd_credentials

    target = config.rendezvous.etcd
    assert target is not None

    async def read() -> DurableState | None:
        client = EtcdClient(target, etcd_credentials(config.rendezvous))
        try:
            return await Election(client, config.job, config.rendezvous.lease_ttl).recorded_state()
        except BadJobState as e:  # not what a tfelastic coordinator writes: as for a coordinator, exit 78
            raise ConfigError(str(e)) from None
        except EtcdError as e:
            raise OperatorError(f"etcd at {target} does not answer: {e}") from None
        finally:
            await client.close()

    recorded = asyncio.run(read())
    if recorded is None:
        raise OperatorError(f"etcd at {target} holds no state of job {config.job!r} (--job names it)")
    view = _view(recorded)
    return {"job": config.job, "state": recorded.state.value, "reason": recorded.reason, "source": "etcd",
            "goodput": goodput_json(view), "generations": timeline_json(view), "marks": marks_json(view),
            "at": time.time()}


def _view(recorded: DurableState) -> GoodputView | None:
    if recorded.goodput is None:
        return None
    return ledger_of_export(recorded.goodput, time.time()).view(0.0)
