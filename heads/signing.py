"""Signed packages: who made a package or export, checked before anything in it is trusted.

A manifest (``heads.manifest``) says which bytes belong to a package, but anyone can rewrite it to
match changed files. Every folder draftsmith writes (``save_package``, ``update_package_json``,
``scripts/export.py``, ``scripts/release.py``) is therefore signed with OpenSSF
`model-signing <https://github.com/sigstore/model-transparency>`_ (an elliptic-curve key, a
Sigstore bundle in ``model.sig`` over the sha256 of every file, the manifest included; symbolic
links are refused), and loading checks the signature against the trusted keys.

Keys:

* the local signing key, made on first use: the PEM private key at ``$DRAFTSMITH_SIGNING_KEY``,
  default ``$XDG_CONFIG_HOME/draftsmith/signing-key.pem`` (``~/.config/...``), mode 0600; its
  public key beside it as ``signing-key.pub`` (:func:`public_key_of`).
* a key's fingerprint: the first 16 hex digits of the sha256 of its DER public key.

Trusted signers: the local key, the public keys in the repository's ``releases/keys/`` (the
released packages' key), the PEM files or folders of ``$DRAFTSMITH_TRUSTED_KEYS``
(``os.pathsep``-separated) and a ``trusted_keys=`` argument. ``allow_unsigned=True`` (or
``DRAFTSMITH_ALLOW_UNSIGNED=1``) loads an unsigned or untrusted folder with a loud warning.

A certificate identity: where the user holds an X.509 signing certificate for their key (an
organisation's PKI), ``$DRAFTSMITH_SIGNING_CERT`` names it (PEM) and
``$DRAFTSMITH_SIGNING_CERT_CHAIN`` its issuers (PEM files, ``os.pathsep``-separated); folders are
then signed with model-signing's certificate signer, and the signer is named by the
certificate's subject. A PEM CA certificate among the trusted keys is a trusted root: a folder
signed by any certificate it issued verifies. (Sigstore's keyless identities need its online
services and are not wired here: ``model_signing sign sigstore`` signs such a folder and
``model_signing verify sigstore`` checks it.)

Command line (``draftsmith-sign``, or ``python -m draftsmith.heads.signing``)::

    draftsmith-sign key            # the local public key's path and fingerprint
    draftsmith-sign sign DIR       # check DIR's manifest, then sign it with the local key
    draftsmith-sign verify DIR     # check DIR's signature (and print the signer)

The other side verifies a signature with model-signing itself::

    model_signing verify key DIR --signature DIR/model.sig --public_key KEY.pub

The model card ``DIR/README.md`` is not signed (``heads.manifest``): signatures record it among
their ignored paths, so that command passes with a card beside them; a folder signed before
that (the committed ``releases/eagle3-smollm2-135m``) needs ``--ignore-paths DIR/README.md``.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from draftsmith.heads.manifest import (
    CARD,
    MANIFEST,
    SIGNATURE,
    PackageIntegrityError,
    read_manifest,
    verify_manifest,
    write_json_atomic,
)

log = logging.getLogger(__name__)

KEY_ENV = "DRAFTSMITH_SIGNING_KEY"
CERT_ENV = "DRAFTSMITH_SIGNING_CERT"
CERT_CHAIN_ENV = "DRAFTSMITH_SIGNING_CERT_CHAIN"
TRUSTED_ENV = "DRAFTSMITH_TRUSTED_KEYS"
ALLOW_UNSIGNED_ENV = "DRAFTSMITH_ALLOW_UNSIGNED"
RELEASE_KEYS = Path(__file__).resolve().parents[1] / "releases" / "keys"
KEY_SUFFIXES = (".pub", ".pem")
_TRUSTED_FIX = (f"if you trust whoever signed it, add their public key to {TRUSTED_ENV} "
                "(PEM files or folders, os.pathsep-separated) or pass trusted_keys=")
_UNSAFE_FIX = (f"to load it anyway (unsafe) pass allow_unsigned=True or set "
               f"{ALLOW_UNSIGNED_ENV}=1.")


class PackageSignatureError(PackageIntegrityError):
    """A folder is unsigned, signed by an untrusted key, or its signature does not match."""

    def __init__(self, path: Path | str, problem: str, fix: str):
        super().__init__(path, [problem], fix=f"{fix}; {_UNSAFE_FIX}", check="signature check")


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


def unsigned_allowed(allow_unsigned: bool = False) -> bool:
    """``allow_unsigned`` or ``DRAFTSMITH_ALLOW_UNSIGNED`` set to 1 / true / yes."""
    env = os.environ.get(ALLOW_UNSIGNED_ENV, "").strip().lower()
    return bool(allow_unsigned) or env in ("1", "true", "yes")


# ----------------------------------------------------------------------------- sign / verify
def _hashing() -> Any:
    from model_signing import hashing

    # the model card (README.md) is documentation beside the signed files, as model-signing's
    # own example treats it: a signature made now records it among its ignored paths
    return (hashing.Config().set_ignored_paths(paths=[SIGNATURE, CARD], ignore_git_paths=False)
            .use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False))


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


def sign_folder(root: str | Path, private_key: str | Path | None = None) -> str:
    """Sign the package or export folder ``root`` (after its manifest is written).

    Records the signer (fingerprint and PEM public key, and the certificate's subject when one
    is configured) in ``manifest.json``, then writes ``model.sig`` over every file but itself.
    Returns the signer: the key's fingerprint, or the certificate identity.
    """
    from model_signing import signing

    from draftsmith.heads.peer_format import refuse_peer

    refuse_peer(root := Path(root).resolve(), "sign")  # a peer's checkpoint is never ours
    key_path = local_signing_key(private_key)
    public = _load_private(key_path).public_key()
    fp = fingerprint(public)
    signer: dict[str, Any] = {"fingerprint": fp, "public_key": _pem(public).decode()}
    config, who = signing.Config(), fp
    cert = signing_certificate()
    if cert is None:
        config.use_elliptic_key_signer(private_key=key_path)
    else:
        leaf = x509.load_pem_x509_certificate(cert[0].read_bytes())
        if _pem(leaf.public_key()) != _pem(public):
            raise ValueError(f"the signing certificate {cert[0]} ({CERT_ENV}) certifies another "
                             f"key than the signing key {key_path} ({KEY_ENV}, fingerprint {fp}):"
                             f" point {KEY_ENV} at the certificate's private key")
        who = _identity(leaf)
        signer["certificate"] = who
        config.use_certificate_signer(private_key=key_path, signing_certificate=cert[0],
                                      certificate_chain=cert[1] or [cert[0]])  # none: itself
    manifest = read_manifest(root)
    manifest["signer"] = signer
    write_json_atomic(root / MANIFEST, manifest)
    tmp = root / f".{SIGNATURE}.tmp-{os.getpid()}"  # hashed before it exists
    try:
        config.set_hashing_config(_hashing()).sign(root, tmp)
        os.replace(tmp, root / SIGNATURE)
    finally:
        tmp.unlink(missing_ok=True)
    return who


def _claimed_signer(root: Path, hint: str) -> str:
    """The signer's fingerprint as the manifest records it, when it matches the signature."""
    try:
        pem = json.loads((root / MANIFEST).read_text())["signer"]["public_key"].encode()
        key = serialization.load_pem_public_key(pem)
        if isinstance(key, ec.EllipticCurvePublicKey) and _pem_hint(key) == hint:
            return fingerprint(key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"an unknown key (sha256 of its PEM {hint[:16]}...)"
    return f"an unknown key (sha256 of its PEM {hint[:16]}...)"


def _mismatch(message: str) -> str:
    """The file names in model-signing's "Signature mismatch: [...]" message (a list's repr: a
    name may be quoted with ' or ", with or without a backslash)."""
    q = r"\\?['\"]"
    names = re.findall(rf"Hash mismatch for {q}(.+?){q}: Expected", message)
    for what, how in (("Extra", "unsigned extra"), ("Missing", "missing")):
        m = re.search(rf"{what} files (?:found )?in model {q}.*?{q}: (.+?){q}?(?:,\s*{q}|\]|$)",
                      message)
        if m:
            names += [f"{n.strip()} ({how})" for n in m.group(1).split(", ")]
    return ", ".join(sorted(names)) if names else message


def verify_folder_signature(root: str | Path,
                            trusted_keys: Iterable[str | Path] | str | Path | None = None) -> str:
    """Check ``root``'s signature against the trusted keys; returns the signer's fingerprint.

    Raises:
        PackageSignatureError: unsigned, signed by an untrusted key, or the signature does not
            match the files (one changed after signing, even with a manifest rewritten to match).
    """
    from model_signing import verifying

    root = Path(root).resolve()
    sig = root / SIGNATURE
    if sig.is_symlink() or not sig.is_file():
        raise PackageSignatureError(
            root, f"it is not signed (no {SIGNATURE}), so who made it is unknown",
            "re-save or re-export it with this draftsmith (which signs what it writes), or, if "
            "you made it and it is intact, sign it: python -m draftsmith.heads.signing sign DIR")
    try:
        material = json.loads(sig.read_text())["verificationMaterial"]
        if "x509CertificateChain" in material:
            raw = material["x509CertificateChain"]["certificates"][0]["rawBytes"]
            leaf = x509.load_der_x509_certificate(base64.b64decode(raw))
        else:
            hint = material["publicKey"]["hint"]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise PackageSignatureError(root, f"{SIGNATURE} is not a model-signing signature ({e})",
                                    "re-download or re-export the package") from e
    if "x509CertificateChain" in material:
        return _verify_certificate(root, _identity(leaf), trusted_keys)
    trusted = trusted_public_keys(trusted_keys)
    match = [(fp, f) for fp, (f, _) in trusted.items() if _pem_hint(_load_public(f)) == hint]
    if not match:
        listed = ", ".join(f"{fp} ({where})" for fp, (_, where) in trusted.items()) or "none"
        raise PackageSignatureError(
            root, f"it is signed by {_claimed_signer(root, hint)}, which is not trusted "
                  f"(trusted keys: {listed})", _TRUSTED_FIX)
    fp, pub = match[0]
    try:
        verifying.Config().use_elliptic_key_verifier(public_key=pub).set_hashing_config(
            _hashing()).verify(root, sig)
    except Exception as e:  # model-signing raises ValueError, cryptography InvalidSignature, ...
        raise PackageSignatureError(
            root, f"its signature by key {fp} does not match its files: {_mismatch(str(e))} "
                  "changed after it was signed (a manifest rewritten to match is refused too)",
            "re-download the package or re-export it from a trusted copy") from e
    return fp


def _verify_certificate(root: Path, who: str,
                        trusted_keys: Iterable[str | Path] | str | Path | None) -> str:
    """Check a certificate-signed folder against every trusted CA; returns the identity."""
    from model_signing import verifying

    roots = trusted_roots(trusted_keys)
    for ca, _ in roots:
        try:
            verifying.Config().use_certificate_verifier(certificate_chain=[ca]).set_hashing_config(
                _hashing()).verify(root, root / SIGNATURE)
            return who
        except ValueError as e:
            if "mismatch" in str(e):
                raise PackageSignatureError(
                    root, f"its signature by {who} does not match its files: "
                          f"{_mismatch(str(e))} changed after it was signed",
                    "re-download the package or re-export it from a trusted copy") from e
        except Exception as e:  # noqa: BLE001 - OpenSSL's chain errors: not issued by this CA
            log.debug("%s is not issued by %s: %s", root, ca, e)
    listed = ", ".join(where for _, where in roots) or "none"
    raise PackageSignatureError(
        root, f"it is signed by {who}, which no trusted CA certificate issued (trusted CAs: "
              f"{listed})", _TRUSTED_FIX + " (a CA's PEM certificate trusts what it issued)")


# ----------------------------------------------------------------------------- command line
CLI_USAGE = ("usage: python -m draftsmith.heads.signing key | sign DIR | verify DIR "
             "(or action=... dir=DIR)")


def run(cfg: Any) -> None:
    """One command of ``conf/eval/signing.yaml``: ``action`` key | sign | verify (``dir``)."""
    folder = None if cfg.dir is None else str(cfg.dir)
    if cfg.action == "key":
        pub = public_key_of()
        print(f"{pub} (fingerprint {fingerprint(_load_public(pub))})")
    elif cfg.action in ("sign", "verify") and folder is not None:
        if cfg.action == "sign":
            verify_manifest(Path(folder))  # never sign files that do not match the manifest
            print(f"signed {folder} as {sign_folder(folder)}")
        else:
            print(f"{folder} is signed by trusted {verify_folder_signature(folder)}")
    else:
        sys.exit(f"action={cfg.action} dir={folder}: {CLI_USAGE}")


def cli_overrides(argv: list[str]) -> list[str]:
    """The documented forms ``key``, ``sign DIR``, ``verify DIR`` as Hydra overrides."""
    if not argv or argv[0] not in ("key", "sign", "verify"):
        return list(argv)
    rest = argv[1:]
    if rest and "=" not in rest[0] and not rest[0].startswith("-"):
        rest = ["dir='" + rest[0].replace("'", "\\'") + "'", *rest[1:]]
    return [f"action={argv[0]}", *rest]


def main() -> None:
    """Command line: ``key | sign DIR | verify DIR``, or Hydra overrides of its config."""
    import hydra

    sys.argv[1:] = cli_overrides(sys.argv[1:])
    conf = str(Path(__file__).resolve().parents[1] / "conf" / "eval")
    hydra.main(config_path=conf, config_name="signing", version_base="1.3")(run)()


if __name__ == "__main__":
    main()
