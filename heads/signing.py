"""Signed packages: who made a package or export, checked before anything in it is trusted.

A manifest (``heads.manifest``) says which bytes belong to a package, but anyone can rewrite it to
match changed files. Every folder draftsmith writes (``save_package``, ``update_package_json``,
``scripts/export.py``, ``scripts/release.py``) is therefore signed with OpenSSF
`model-signing <https://github.com/sigstore/model-transparency>`_ (an elliptic-curve key, a
Sigstore bundle in ``model.sig`` over the sha256 of every file, the manifest included; symbolic
links are refused), and loading checks the signature against the trusted keys.

The keys, their fingerprints and the trusted signers are ``heads.keys``: folders are signed with
the local signing key and verified against the trusted keys. ``allow_unsigned=True`` (or
``DRAFTSMITH_ALLOW_UNSIGNED=1``) loads an unsigned or untrusted folder with a loud warning.

With a signing certificate configured (``$DRAFTSMITH_SIGNING_CERT``, ``heads.keys``), folders
are signed with model-signing's certificate signer, and the signer is named by the
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

from draftsmith.heads.keys import (
    CERT_ENV,
    KEY_ENV,
    TRUSTED_ENV,
    _identity,
    _load_private,
    _load_public,
    _pem,
    _pem_hint,
    fingerprint,
    local_signing_key,
    public_key_of,
    signing_certificate,
    trusted_public_keys,
    trusted_roots,
)
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

ALLOW_UNSIGNED_ENV = "DRAFTSMITH_ALLOW_UNSIGNED"
_TRUSTED_FIX = (f"if you trust whoever signed it, add their public key to {TRUSTED_ENV} "
                "(PEM files or folders, os.pathsep-separated) or pass trusted_keys=")
_UNSAFE_FIX = (f"to load it anyway (unsafe) pass allow_unsigned=True or set "
               f"{ALLOW_UNSIGNED_ENV}=1.")


class PackageSignatureError(PackageIntegrityError):
    """A folder is unsigned, signed by an untrusted key, or its signature does not match."""

    def __init__(self, path: Path | str, problem: str, fix: str):
        super().__init__(path, [problem], fix=f"{fix}; {_UNSAFE_FIX}", check="signature check")


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
