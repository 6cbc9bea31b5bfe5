"""`--ssl-*` on `quire serve` and `quire router`: what each accepts, and the one-line errors
(naming the flag) for what would not work, given before any model loads."""

from __future__ import annotations

import ssl

import pytest

from quire.entrypoints.cli import main
from quire.router.cli import main as router_main

from tls_certs import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.parametrize("given, meant", [
    ("0", ssl.CERT_NONE), ("1", ssl.CERT_OPTIONAL), ("2", ssl.CERT_REQUIRED),
    ("CERT_REQUIRED", ssl.CERT_REQUIRED), ("optional", ssl.CERT_OPTIONAL), ("none", ssl.CERT_NONE),
])
def test_cert_reqs_takes_uvicorns_numbers_and_ssls_names(given, meant):
    from quire.entrypoints.cli import build_parser
    ns = build_parser().parse_args(["serve", "--ssl-cert-reqs", given])
    assert ns.ssl_cert_reqs == meant


@pytest.mark.parametrize("bad", ["3", "-1", "yes", ""])
def test_a_bad_cert_reqs_names_the_flag(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--ssl-cert-reqs", bad])
    assert exit_.value.code == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert "argument --ssl-cert-reqs:" in error and "0 (CERT_NONE), 1 (CERT_OPTIONAL), 2 (CERT_REQUIRED)" in error


def _refusals(pki, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM")
    key_pair = ["--ssl-certfile", pki.server_cert, "--ssl-keyfile", pki.server_key]
    return [
        (["--ssl-certfile", pki.server_cert], "--ssl-certfile needs --ssl-keyfile"),
        (["--ssl-keyfile", pki.server_key], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-ca-certs", pki.ca], "--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile"),
        (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs needs --ssl-certfile and --ssl-keyfile"),
        ([*key_pair, "--ssl-cert-reqs", "2"], "--ssl-cert-reqs 2 needs --ssl-ca-certs"),
        (["--ssl-certfile", pki.server_cert, "--ssl-keyfile", str(tmp_path / "nope.pem")],
         "--ssl-keyfile: cannot read"),
        (["--ssl-certfile", pki.server_cert, "--ssl-keyfile", pki.client_key],  # another key
         "not a PEM certificate and its matching private key"),
        ([*key_pair, "--ssl-ca-certs", str(junk)], "--ssl-ca-certs: cannot load CA certificates"),
    ]


def test_serve_refuses_tls_flags_that_cannot_work(pki, tmp_path, capsys):
    for flags, said in _refusals(pki, tmp_path):
        assert main(["serve", *flags]) == 2, flags
        err = capsys.readouterr().err.strip()
        assert err.startswith("quire: error: ") and said in err and "\n" not in err, (flags, err)


def test_router_refuses_them_too(pki, tmp_path, capsys):
    for flags, said in _refusals(pki, tmp_path):
        assert router_main(["--backend", "http://127.0.0.1:9", *flags]) == 2, flags
        err = capsys.readouterr().err.strip()
        assert err.startswith("quire router: error: ") and said in err and "\n" not in err, (flags, err)
