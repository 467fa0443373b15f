"""Signing keys and trusted signers: whose signature a package carries, and whose is trusted.

Keys:

* the local signing key, made on first use: the PEM private key at ``$DRAFTSMITH_SIGNING_KEY``,
  default ``$XDG_CONFIG_HOME/draftsmith/signing-key.pem`` (``~/.config/...``), mode 0600; its
  public key beside it as ``signing-key.pub`` (:func:`public_key_of`).
* a key's fingerprint: the first 16 hex digits of the sha256 of its DER public key.

Trusted signers: the local key, the public keys in the repository's ``releases/keys/`` (the
released packages' key), the PEM files or folders of ``$DRAFTSMITH_TRUSTED_KEYS``
(``os.pathsep``-separated) and a ``trusted_keys=`` argument.

A certificate identity: where the user holds an X.509 signing certificate for their key (an
organisation's PKI), ``$DRAFTSMITH_SIGNING_CERT`` names it (PEM) and
``$DRAFTSMITH_SIGNING_CERT_CHAIN`` its issuers (PEM files, ``os.pathsep``-separated)
(:func:`signing_certificate`); the signer is then named by the certificate's subject. A PEM CA
certificate among the trusted keys is a trusted root (:func:`trusted_roots`).
"""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

log = logging.getLogger(__name__)

KEY_ENV = "DRAFTSMITH_SIGNING_KEY"
CERT_ENV = "DRAFTSMITH_SIGNING_CERT"
CERT_CHAIN_ENV = "DRAFTSMITH_SIGNING_CERT_CHAIN"
TRUSTED_ENV = "DRAFTSMITH_TRUSTED_KEYS"
RELEASE_KEYS = Path(__file__).resolve().parents[1] / "releases" / "keys"
KEY_SUFFIXES = (".pub", ".pem")


# ----------------------------------------------------------------------------- keys
def signing_key_path() -> Path:
    """Where the local private signing key lives (it need not exist yet)."""
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config) / "draftsmith" / "signing-key.pem"


def fingerprint(public_key: ec.EllipticCurvePublicKey) -> str:
    """First 16 hex digits of the sha256 of the DER public key."""
    der = public_key.public_bytes(serialization.Encoding.DER,
                                  serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()[:16]


def _pem(public_key: ec.EllipticCurvePublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.PEM,
                                   serialization.PublicFormat.SubjectPublicKeyInfo)


def _pem_hint(public_key: ec.EllipticCurvePublicKey) -> str:
    """model-signing's key hint in a signature: the sha256 of the PEM public key."""
    return hashlib.sha256(_pem(public_key)).hexdigest()


def local_signing_key(path: str | Path | None = None) -> Path:
    """The private signing key at ``path`` (default :func:`signing_key_path`), made on first use.

    A new key is an EC P-256 PEM key written with mode 0600 (atomically: concurrent first uses
    agree on one key); a log line names its path and fingerprint.
    """
    path = Path(path).expanduser() if path is not None else signing_key_path()
    if path.is_file():
        if path.stat().st_mode & 0o077:
            log.warning("signing key %s is readable by other users; chmod 600 it", path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # fails if another process made the key first: theirs is used
        made = True
    except FileExistsError:
        made = False
    finally:
        tmp.unlink()
    if made:
        log.warning("created a new draftsmith signing key %s (fingerprint %s); packages written "
                    "here are signed with it. Others trust them with its public key %s "
                    "(%s).", path, fingerprint(key.public_key()), public_key_of(path), TRUSTED_ENV)
    return path


def _load_private(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"signing key {path} is not an elliptic-curve key (model-signing signs "
                         "with EC P-256/384/521 keys)")
    return key


def public_key_of(private_key: str | Path | None = None) -> Path:
    """The PEM public key of a private key (default: the local one, made if missing), written
    beside it as ``<name>.pub``; returns that file's path."""
    path = local_signing_key(private_key)
    pub = path.with_suffix(".pub")
    pem = _pem(_load_private(path).public_key())
    if not pub.is_file() or pub.read_bytes() != pem:
        tmp = pub.with_name(f".{pub.name}.tmp-{os.getpid()}")
        tmp.write_bytes(pem)
        os.replace(tmp, pub)
    return pub


# ----------------------------------------------------------------------------- trusted signers
def _load_public(path: Path) -> ec.EllipticCurvePublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except ValueError as e:
        raise ValueError(f"trusted key {path} is not a PEM public key ({e})") from e
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise TypeError(f"trusted key {path} is not an elliptic-curve public key")
    return key


def _is_certificate(path: Path) -> bool:
    return b"-----BEGIN CERTIFICATE-----" in path.read_bytes()


def _key_files(entry: Path, where: str) -> list[Path]:
    if entry.is_dir():  # its PEM public keys and certificates (private keys are skipped)
        return sorted(p for p in entry.iterdir() if p.suffix in KEY_SUFFIXES + (".crt",)
                      and p.is_file() and (b"-----BEGIN PUBLIC KEY-----" in p.read_bytes()
                                           or _is_certificate(p)))
    if entry.is_file():
        return [entry]
    raise ValueError(f"trusted key {entry} ({where}) does not exist; fix or remove the entry")


def _trusted_entries(trusted_keys: Iterable[str | Path] | str | Path | None
                     ) -> list[tuple[Path, str]]:
    """Every trusted PEM file (public key or CA certificate) and where it is trusted from."""
    entries: list[tuple[Path, str]] = []
    if RELEASE_KEYS.is_dir():
        entries.append((RELEASE_KEYS, "releases/keys"))
    entries += [(Path(p).expanduser(), TRUSTED_ENV)
                for p in os.environ.get(TRUSTED_ENV, "").split(os.pathsep) if p]
    if isinstance(trusted_keys, (str, Path)):
        trusted_keys = [trusted_keys]
    entries += [(Path(p).expanduser(), "trusted_keys=") for p in trusted_keys or ()]
    return [(f, f"{where}: {f}") for entry, where in entries for f in _key_files(entry, where)]


def trusted_roots(trusted_keys: Iterable[str | Path] | str | Path | None = None
                  ) -> list[tuple[Path, str]]:
    """The trusted CA certificates (PEM certificates among the trusted keys)."""
    return [(f, where) for f, where in _trusted_entries(trusted_keys) if _is_certificate(f)]


def trusted_public_keys(trusted_keys: Iterable[str | Path] | str | Path | None = None
                        ) -> dict[str, tuple[Path, str]]:
    """Fingerprint -> (public key file, where it is trusted from) of every trusted signer."""
    out: dict[str, tuple[Path, str]] = {}
    if signing_key_path().is_file():
        out[fingerprint(_load_public(public_key_of(signing_key_path())))] = (
            public_key_of(signing_key_path()), "the local signing key")
    for f, where in _trusted_entries(trusted_keys):
        if not _is_certificate(f):
            out.setdefault(fingerprint(_load_public(f)), (f, where))
    return out


# ----------------------------------------------------------------------------- certificates
def signing_certificate() -> tuple[Path, list[Path]] | None:
    """The signing certificate and its issuers' certificates named by ``$DRAFTSMITH_SIGNING_CERT``
    and ``$DRAFTSMITH_SIGNING_CERT_CHAIN``, or None (sign with the bare key)."""
    cert = os.environ.get(CERT_ENV, "").strip()
    if not cert:
        return None
    chain = [Path(p).expanduser() for p in os.environ.get(CERT_CHAIN_ENV, "").split(os.pathsep)
             if p]
    for p in [Path(cert).expanduser(), *chain]:
        if not p.is_file():
            raise ValueError(f"{CERT_ENV} / {CERT_CHAIN_ENV} name {p}, which does not exist: fix "
                             f"the path, or unset {CERT_ENV} to sign with the key alone")
    return Path(cert).expanduser(), chain


def _identity(cert: x509.Certificate) -> str:
    return (f"{cert.subject.rfc4514_string()} (certificate issued by "
            f"{cert.issuer.rfc4514_string()})")
