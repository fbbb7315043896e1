"""The UI's HTTP side: the page, its static files, and a small JSON API the page polls.

Reading is open to whoever reaches the port (loopback by default). A change (a rescale) must
carry the secret: the page's first URL (``/?secret=...``, printed when the UI starts) sets it as
a same-site, HTTP-only cookie, and scripts send it as ``X-Stretch-Secret``. The control plane's
rule holds: whoever may change a job holds its secret."""

from __future__ import annotations

import hmac
import json
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from stretch.ui.history import History, instance_busy, series
from stretch.ui.sources import Refused

STATIC = Path(__file__).parent / "static"
SECRET_HEADER = "X-Stretch-Secret"


def make_app(history: History, secret: str) -> Starlette:
    def cookie_name(request: Request) -> str:
        return f"stretch_ui_{request.url.port or 0}"  # cookies ignore ports: one per UI

    def may_change(request: Request) -> bool:
        given = request.headers.get(SECRET_HEADER) or request.cookies.get(cookie_name(request)) or ""
        return hmac.compare_digest(given.encode(), secret.encode())

    async def index(request: Request) -> Response:
        given = request.query_params.get("secret")
        if given is None:
            return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})
        if not hmac.compare_digest(given.encode(), secret.encode()):
            return JSONResponse({"error": "wrong secret"}, status_code=403)
        response = RedirectResponse("/", status_code=303)  # the secret leaves the address bar
        secure = request.url.scheme == "https"  # served over TLS: never sent in the clear
        response.set_cookie(cookie_name(request), secret, httponly=True, samesite="strict", secure=secure)
        return response

    async def overview(request: Request) -> Response:
        with history.lock:
            jobs = [
                {
                    "key": key,
                    "job_id": j.status.get("job_id"),
                    "name": j.status.get("name"),
                    "status": j.status.get("status"),
                    "where": j.status.get("where"),
                    "silent_s": round(time.time() - j.seen_at, 1),
                }
                for key, j in sorted(
                    history.jobs.items(), key=lambda kv: (kv[1].status.get("name") or "", kv[0])
                )
            ]
        has_cluster = any(s.is_cluster for s in history.sources)
        return JSONResponse({"jobs": jobs, "cluster": has_cluster, "can_change": may_change(request)})

    async def job(request: Request) -> Response:
        key = request.query_params.get("key", "")
        with history.lock:
            j = history.jobs.get(key)
            if j is None:
                return JSONResponse({"error": f"no job {key!r} (it ended, or never ran)"}, status_code=404)
            busy = instance_busy(j.previous or {}, j.status, j.seen_at - j.previous_t) if j.previous else {}
            body = {
                "status": j.status,
                "busy": busy,
                "series": series(list(j.samples)),
                "events": list(j.events),
                "seen_at": j.seen_at,
            }
        return JSONResponse(body)

    async def rescale(request: Request) -> Response:
        if not may_change(request):
            return JSONResponse(
                {"error": "a rescale needs the UI's secret: open the URL the UI printed when it started"},
                status_code=403,
            )
        try:
            body = json.loads(await request.body())
            key, operator, parallelism = body["job"], body["operator"], int(body["parallelism"])
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": "a rescale needs job, operator and parallelism"}, status_code=400)
        index, _, job_key = key.partition(":")
        try:
            source = history.sources[int(index)]
            report = await run_in_threadpool(source.rescale, job_key, operator, parallelism)
        except (Refused, LookupError, ValueError, TypeError, IndexError) as e:
            return JSONResponse({"error": str(e).strip("'\"")}, status_code=409)
        await run_in_threadpool(history.poll)  # the page's next look shows the new shape
        return JSONResponse({"ok": True, "report": report})

    async def cluster(request: Request) -> Response:
        for source in history.sources:
            if source.is_cluster:
                return JSONResponse(await run_in_threadpool(source.cluster))
        return JSONResponse({"error": "this UI serves no cluster"}, status_code=404)

    return Starlette(
        routes=[
            Route("/", index),
            Route("/api/overview", overview),
            Route("/api/job", job),
            Route("/api/rescale", rescale, methods=["POST"]),
            Route("/api/cluster", cluster),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
    )
