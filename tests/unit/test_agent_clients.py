"""The episode clients a workflow is handed: one per episode, so making one must be cheap. httpx
loads the CA bundle for every transport it builds (about 20 ms); a step of 512 episodes spent
10 s on that alone (BENCHMARKS.md, Rollout workflows). The clients share one TLS context, which
still verifies certificates and host names."""

from __future__ import annotations

import ssl

import pytest

pytest.importorskip("openai")

from fsdpfn.rollout.agent import AsyncEpisodeClient, EpisodeClient  # noqa: E402


@pytest.mark.parametrize("cls", [EpisodeClient, AsyncEpisodeClient])
def test_clients_after_the_first_load_no_certificates(cls, monkeypatch):
    cls("http://127.0.0.1:1")  # the process's first may build the shared context
    loads = []
    real = ssl.SSLContext.load_verify_locations

    def counted(self, *args, **kwargs):
        loads.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    clients = [cls("http://127.0.0.1:1", seed=i) for i in range(16)]
    assert loads == []
    transports = {id(c._client._transport.inner) for c in clients}
    assert len(transports) == 16  # each episode keeps its own connections and seeds


@pytest.mark.parametrize("cls", [EpisodeClient, AsyncEpisodeClient])
def test_the_shared_context_still_verifies_servers(cls):
    client = cls("https://127.0.0.1:1")
    pool = client._client._transport.inner._pool
    context = pool._ssl_context
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    assert context.cert_store_stats()["x509_ca"] > 0  # a CA bundle is loaded
