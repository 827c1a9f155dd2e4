"""``RemoteBackend``: the controller API over its Unix socket or TCP, as a Backend."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx

from forkd import errors
from forkd.engine.paths import run_dir

TYPES: dict[str, type[errors.ForkdError]] = {
    cls.__name__: cls
    for cls in (
        errors.InvalidInput,
        errors.NotFound,
        errors.IntegrityError,
        errors.ChainError,
        errors.Conflict,
    )
}


class ControllerError(errors.ForkdError):
    """The daemon answered with an error (its message and exit code are kept)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def default_socket() -> Path:
    return run_dir() / "controller.sock"


class RemoteBackend:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        socket: Path | None = None,
        timeout: float = 600.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if url:
            self.http = httpx.Client(base_url=url, headers=headers, timeout=timeout)
            self.where = url
        else:
            path = socket or default_socket()
            transport = httpx.HTTPTransport(uds=str(path))
            self.http = httpx.Client(
                transport=transport, base_url="http://forkd", headers=headers, timeout=timeout
            )
            self.where = str(path)

    def close(self) -> None:
        self.http.close()

    def alive(self) -> bool:
        try:
            return self.http.get("/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _call(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self.http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise ControllerError(
                f"controller at {self.where} unreachable: {exc}; is `forkd serve` running?"
            ) from exc
        if resp.status_code >= 400:
            try:
                err = resp.json()["error"]
                cls = TYPES.get(err.get("type", ""))
                if cls is not None:
                    raise cls(err["message"])
                raise ControllerError(err["message"], int(err.get("exit_code", 1)))
            except (ValueError, KeyError, TypeError):
                raise ControllerError(
                    f"controller answered {resp.status_code}: {resp.text[:200]}"
                ) from None
        return resp

    def _json(self, method: str, url: str, **kwargs: Any) -> Any:
        return self._call(method, url, **kwargs).json()

    def snapshots(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._json("GET", "/v1/snapshots")
        return result

    def snapshot(self, ref: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", f"/v1/snapshots/{ref}")
        return result

    def delete_snapshot(self, ref: str, cascade: bool = False) -> list[str]:
        result = self._json(
            "DELETE", f"/v1/snapshots/{ref}", params={"cascade": str(cascade).lower()}
        )
        removed: list[str] = result["removed"]
        return removed

    def compact(self, ref: str, to: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("POST", "/v1/compact", json={"ref": ref, "to": to})
        return result

    def spawn(
        self,
        tag: str,
        n: int = 1,
        memory_limit_mib: int | None = None,
        netns: bool = False,
        sandbox: bool = True,
        prewarm: int | None = None,
        *,
        timeout: float | None = None,
        on_timeout: str = "kill",
        cpus: float | None = None,
        pids_max: int | None = None,
        disk_bps: int | None = None,
        disk_iops: int | None = None,
        net_kbit: int | None = None,
    ) -> dict[str, Any]:
        body = {
            "tag": tag,
            "n": n,
            "memory_limit_mib": memory_limit_mib,
            "netns": netns,
            "sandbox": sandbox,
            "prewarm": prewarm,
            "timeout": timeout,
            "on_timeout": on_timeout,
            "cpus": cpus,
            "pids_max": pids_max,
            "disk_bps": disk_bps,
            "disk_iops": disk_iops,
            "net_kbit": net_kbit,
        }
        result: dict[str, Any] = self._json("POST", "/v1/sandboxes", json=body)
        return result

    def extend(self, sandbox_id: str, seconds: float) -> dict[str, Any]:
        result: dict[str, Any] = self._json(
            "POST", f"/v1/sandboxes/{sandbox_id}/extend", json={"seconds": seconds}
        )
        return result

    def pause(self, sandbox_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("POST", f"/v1/sandboxes/{sandbox_id}/pause")
        return result

    def resume(self, sandbox_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("POST", f"/v1/sandboxes/{sandbox_id}/resume")
        return result

    def pools(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._json("GET", "/v1/pools")
        return result

    def fill_pool(
        self,
        tag: str,
        k: int,
        memory_limit_mib: int | None = None,
        netns: bool = False,
        sandbox: bool = True,
        wait: bool = False,
    ) -> dict[str, Any]:
        body = {
            "tag": tag,
            "k": k,
            "memory_limit_mib": memory_limit_mib,
            "netns": netns,
            "sandbox": sandbox,
            "wait": wait,
        }
        result: dict[str, Any] = self._json("POST", "/v1/pools", json=body)
        return result

    def remove_pool(self, tag: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("DELETE", f"/v1/pools/{tag}")
        return result

    def sandboxes(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._json("GET", "/v1/sandboxes")
        return result

    def sandbox(self, sandbox_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", f"/v1/sandboxes/{sandbox_id}")
        return result

    def kill(self, sandbox_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("DELETE", f"/v1/sandboxes/{sandbox_id}")
        return result

    def exec(
        self,
        sandbox_id: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"argv": argv, "env": env, "cwd": cwd, "timeout": timeout}
        if stdin is not None:
            body["stdin_b64"] = base64.b64encode(stdin).decode()
        result: dict[str, Any] = self._json("POST", f"/v1/sandboxes/{sandbox_id}/exec", json=body)
        return result

    def eval(self, sandbox_id: str, code: str, timeout: float = 300.0) -> dict[str, Any]:
        result: dict[str, Any] = self._json(
            "POST", f"/v1/sandboxes/{sandbox_id}/eval", json={"code": code, "timeout": timeout}
        )
        return result

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        self._call(
            "PUT",
            f"/v1/sandboxes/{sandbox_id}/files",
            params={"path": path, "mode": mode},
            content=data,
        )

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        return self._call("GET", f"/v1/sandboxes/{sandbox_id}/files", params={"path": path}).content

    def branch(self, sandbox_id: str, tag: str, force: bool = False) -> dict[str, Any]:
        result: dict[str, Any] = self._json(
            "POST", f"/v1/sandboxes/{sandbox_id}/branch", json={"tag": tag, "force": force}
        )
        return result
