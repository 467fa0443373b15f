"""Signed packages (heads/signing.py; the keys and trusted signers, heads/keys.py): who made a
package is checked before it is trusted."""
from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest
from conftest import make_tiny_target

from draftsmith.data.identity import sha256_file
from draftsmith.heads.keys import (
    RELEASE_KEYS,
    _load_public,
    fingerprint,
    local_signing_key,
    public_key_of,
    signing_key_path,
)
from draftsmith.heads.manifest import MANIFEST, SIGNATURE, PackageIntegrityError
from draftsmith.heads.medusa import MedusaConfig, build_medusa
from draftsmith.heads.package import load_package, save_package, update_package_json
from draftsmith.heads.signing import (
    PackageSignatureError,
    sign_folder,
    verify_folder_signature,
)
from draftsmith.heads.weights import WEIGHTS


def _package(tmp_path: Path, name: str = "pkg") -> tuple[Path, object]:
    target = make_tiny_target()
    cfg = MedusaConfig(num_heads=2, num_layers=1)
    return save_package(tmp_path / name, "medusa", build_medusa(cfg, target.model), cfg,
                        target.identity), target


def _fp(pub: Path) -> str:
    return fingerprint(_load_public(pub))


def _local_fp() -> str:
    return _fp(public_key_of())


def _other_key(tmp_path: Path) -> Path:
    """A second signer's private key (someone else's machine)."""
    return local_signing_key(tmp_path / "other" / "key.pem")


def test_a_fresh_key_is_private_logged_and_has_a_public_key(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DRAFTSMITH_SIGNING_KEY", str(tmp_path / "cfg" / "signing-key.pem"))
    with caplog.at_level(logging.WARNING, logger="draftsmith.heads.keys"):
        key = local_signing_key()
    assert key == signing_key_path() == tmp_path / "cfg" / "signing-key.pem"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    pub = public_key_of()
    assert pub == tmp_path / "cfg" / "signing-key.pub" and b"PUBLIC KEY" in pub.read_bytes()
    fp = _fp(pub)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert str(key) in caplog.text and fp in caplog.text
    assert local_signing_key() == key and _fp(public_key_of()) == fp  # made once, then reused
    monkeypatch.delenv("DRAFTSMITH_SIGNING_KEY")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert signing_key_path() == tmp_path / "xdg" / "draftsmith" / "signing-key.pem"


def test_a_saved_package_is_signed_by_the_local_key_and_loads(tmp_path):
    out, target = _package(tmp_path)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["signer"]["fingerprint"] == _local_fp()
    assert SIGNATURE not in manifest["files"]
    assert load_package(out, target=target).info["signer"] == _local_fp()


def test_the_signature_is_plain_model_signing(tmp_path):
    """Anyone can check it with model-signing itself (hashing config guessed from the bundle)."""
    from model_signing import verifying

    out, _ = _package(tmp_path)
    verifying.Config().use_elliptic_key_verifier(public_key=public_key_of()).verify(
        out, out / SIGNATURE)


def test_a_manifest_rewritten_to_match_tampered_weights_is_refused(tmp_path):
    out, target = _package(tmp_path)
    data = bytearray((out / WEIGHTS).read_bytes())
    data[len(data) // 2] ^= 1
    (out / WEIGHTS).write_bytes(bytes(data))
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"][WEIGHTS] = {"sha256": sha256_file(out / WEIGHTS), "size": len(data)}
    (out / MANIFEST).write_text(json.dumps(manifest))  # the manifest alone now "verifies"
    with pytest.raises(PackageSignatureError) as err:
        load_package(out, target=target)
    assert (f"its signature by key {_local_fp()} does not match its files: manifest.json, "
            "model.safetensors changed after it was signed") in str(err.value)
    assert isinstance(err.value, PackageIntegrityError)  # callers catching integrity errors


def test_an_unsigned_package_is_refused_unless_allowed(tmp_path, monkeypatch, caplog):
    out, target = _package(tmp_path)
    (out / SIGNATURE).unlink()
    with pytest.raises(PackageSignatureError) as err:
        load_package(out, target=target)
    msg = str(err.value)
    assert "it is not signed (no model.sig), so who made it is unknown" in msg
    assert "python -m draftsmith.heads.signing sign DIR" in msg and "allow_unsigned=True" in msg
    with caplog.at_level(logging.WARNING, logger="draftsmith.heads.package"):
        pkg = load_package(out, target=target, allow_unsigned=True)
    assert "LOADING AN UNSIGNED OR UNTRUSTED DRAFT PACKAGE" in caplog.text
    assert pkg.info["signer"] is None
    monkeypatch.setenv("DRAFTSMITH_ALLOW_UNSIGNED", "1")
    assert load_package(out, target=target).info["signer"] is None
    (out / "notes.txt").write_text("x")  # the manifest is still checked when unsigned is allowed
    with pytest.raises(PackageIntegrityError, match=r"'notes\.txt' is not listed"):
        load_package(out, target=target, allow_unsigned=True)


def test_a_package_signed_by_another_key_is_refused_naming_both(tmp_path):
    out, target = _package(tmp_path)
    other = _other_key(tmp_path)
    other_fp = sign_folder(out, private_key=other)
    assert other_fp == _fp(public_key_of(other)) != _local_fp()
    with pytest.raises(PackageSignatureError) as err:
        load_package(out, target=target)
    msg = str(err.value)
    assert f"it is signed by {other_fp}, which is not trusted (trusted keys: {_local_fp()} " \
           "(the local signing key)" in msg
    assert "DRAFTSMITH_TRUSTED_KEYS" in msg
    assert load_package(out, target=target, allow_unsigned=True).info["signer"] is None


def test_trusted_keys_from_the_environment_and_the_argument(tmp_path, monkeypatch):
    out, target = _package(tmp_path)
    other = _other_key(tmp_path)
    other_fp = sign_folder(out, private_key=other)
    pub = public_key_of(other)
    assert load_package(out, target=target, trusted_keys=[pub]).info["signer"] == other_fp
    monkeypatch.setenv("DRAFTSMITH_TRUSTED_KEYS", os.pathsep.join([str(tmp_path / "none-here"),
                                                                   str(pub)]))
    with pytest.raises(ValueError, match="none-here .*does not exist"):
        load_package(out, target=target)
    monkeypatch.setenv("DRAFTSMITH_TRUSTED_KEYS", str(pub.parent))  # a folder of .pub files
    assert load_package(out, target=target).info["signer"] == other_fp
    assert verify_folder_signature(out) == other_fp


def test_update_package_json_re_signs(tmp_path):
    out, target = _package(tmp_path)
    other = _other_key(tmp_path)
    sign_folder(out, private_key=other)
    pub = public_key_of(other)
    update_package_json(out, "speculation", {"k_star": 3}, trusted_keys=[pub])
    pkg = load_package(out, target=target)  # re-signed by the local key: trusted by default
    assert pkg.info["signer"] == _local_fp() and pkg.speculation == {"k_star": 3}
    assert "speculation.json" in json.loads((out / MANIFEST).read_text())["files"]


def test_update_package_json_refuses_an_untrusted_or_rewritten_package(tmp_path):
    out, _ = _package(tmp_path)
    sign_folder(out, private_key=_other_key(tmp_path))
    with pytest.raises(PackageSignatureError, match="which is not trusted"):
        update_package_json(out, "speculation", {"k_star": 3})
    assert not (out / "speculation.json").exists()
    (out / SIGNATURE).unlink()
    update_package_json(out, "speculation", {"k_star": 3}, allow_unsigned=True)
    assert not (out / SIGNATURE).exists()  # an unverified package is not vouched for


def test_an_export_is_signed_and_verified(tmp_path):
    from draftsmith.heads.exports import import_export
    from draftsmith.scripts.export import export_package

    out, target = _package(tmp_path)
    exp = export_package(out, "medusa", tmp_path / "medusa")
    assert import_export(exp, target=target).info["signer"] == _local_fp()
    weights = exp / "medusa_lm_head.safetensors"
    state = bytearray(weights.read_bytes())
    state[-1] ^= 1
    weights.write_bytes(bytes(state))
    manifest = json.loads((exp / MANIFEST).read_text())
    manifest["files"][weights.name]["sha256"] = sha256_file(weights)
    (exp / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PackageSignatureError, match="does not match its files"):
        import_export(exp, target=target)


def test_release_keys_are_trusted_by_default():
    keys = sorted(RELEASE_KEYS.glob("*.pub"))
    assert [k.name for k in keys] == ["draftsmith-release-1.pub", "draftsmith-release-2.pub",
                                      "draftsmith-release-3.pub", "draftsmith-release-4.pub",
                                      "draftsmith-release-5.pub", "draftsmith-release-6.pub",
                                      "draftsmith-release.pub"]
    assert all(b"PRIVATE" not in p.read_bytes() for p in RELEASE_KEYS.parent.rglob("*")
               if p.is_file() and p.suffix in (".pub", ".pem", ".key"))  # public keys only
    from draftsmith.heads.keys import trusted_public_keys

    assert {_fp(k) for k in keys} <= set(trusted_public_keys())


def test_a_corrupt_signature_is_refused(tmp_path):
    out, target = _package(tmp_path)
    (out / SIGNATURE).write_text("{}")
    with pytest.raises(PackageSignatureError, match="model.sig is not a model-signing signature"):
        load_package(out, target=target)
    sig = {"verificationMaterial": {"publicKey": {"hint": "0" * 64}}}
    (out / SIGNATURE).write_text(json.dumps(sig))
    with pytest.raises(PackageSignatureError, match="signed by an unknown key"):
        load_package(out, target=target)


# ----------------------------------------------------------------------------- certificates
def _ca(tmp_path: Path, name: str):
    """A CA key and self-signed certificate (an organisation's PKI), written as ``name``.pem."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    path = tmp_path / f"{name.replace(' ', '-')}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


def _leaf(tmp_path: Path, ca, who: str, key_path: Path) -> Path:
    """A code-signing certificate for the private key at ``key_path``, issued by ``ca``."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key, ca_cert, _ = ca
    now = datetime.datetime.now(datetime.timezone.utc)
    public = load_pem_private_key(local_signing_key(key_path).read_bytes(), None).public_key()
    usage = dict.fromkeys(["content_commitment", "key_encipherment", "data_encipherment",
                           "key_agreement", "key_cert_sign", "crl_sign", "encipher_only",
                           "decipher_only"], False)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, who)]))
            .issuer_name(ca_cert.subject).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, **usage), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    path = tmp_path / f"{who}.crt.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def test_a_certificate_identity_signs_and_a_trusted_ca_verifies_it(tmp_path, monkeypatch):
    ca, other_ca = _ca(tmp_path, "Draft CA"), _ca(tmp_path, "Other CA")
    key = tmp_path / "alice" / "key.pem"
    monkeypatch.setenv("DRAFTSMITH_SIGNING_KEY", str(key))
    monkeypatch.setenv("DRAFTSMITH_SIGNING_CERT", str(_leaf(tmp_path, ca, "alice", key)))
    pkg, _ = _package(tmp_path)
    material = json.loads((pkg / SIGNATURE).read_text())["verificationMaterial"]
    assert "x509CertificateChain" in material  # signed with the certificate, not the bare key
    assert json.loads((pkg / MANIFEST).read_text())["signer"]["certificate"].startswith("CN=alice")
    # its own CA is trusted only when listed: the bare local key does not vouch for a certificate
    with pytest.raises(PackageSignatureError, match="CN=alice .*no trusted CA certificate"):
        verify_folder_signature(pkg)
    who = verify_folder_signature(pkg, trusted_keys=[ca[2]])
    assert who == "CN=alice (certificate issued by CN=Draft CA)"
    assert load_package(pkg, trusted_keys=[other_ca[2], ca[2]]).info["signer"] == who
    with pytest.raises(PackageSignatureError, match="no trusted CA certificate issued"):
        load_package(pkg, trusted_keys=[other_ca[2]])  # a CA that did not issue it
    monkeypatch.setenv("DRAFTSMITH_TRUSTED_KEYS", str(tmp_path))  # a folder with both CAs
    assert verify_folder_signature(pkg) == who
    (pkg / "config.json").write_text("{}")  # tampered after signing
    with pytest.raises(PackageSignatureError, match="config.json"):
        verify_folder_signature(pkg)


def test_a_certificate_for_another_key_is_refused_before_signing(tmp_path, monkeypatch):
    ca = _ca(tmp_path, "Draft CA")
    monkeypatch.setenv("DRAFTSMITH_SIGNING_CERT",
                       str(_leaf(tmp_path, ca, "bob", tmp_path / "bob" / "key.pem")))
    with pytest.raises(ValueError, match="certifies another key"):
        _package(tmp_path)
    monkeypatch.setenv("DRAFTSMITH_SIGNING_CERT", str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="does not exist"):
        _package(tmp_path, "pkg2")


def test_a_model_card_is_neither_listed_nor_signed_and_nothing_else_escapes(tmp_path):
    """README.md at the top is documentation (releases/<name>/README.md): written after signing
    it loads; it is left out of the manifest and of new signatures (which record it as ignored,
    so model-signing's own verifier passes too); any other unlisted file is still refused."""
    from model_signing import verifying

    out, target = _package(tmp_path)
    (out / "README.md").write_text("# a card written after signing\n")
    assert load_package(out, target=target).info["signer"] == _local_fp()
    update_package_json(out, "speculation", {"k_star": 1})  # rewrites the manifest, re-signs
    assert "README.md" not in json.loads((out / MANIFEST).read_text())["files"]
    (out / "README.md").write_text("# corrected\n")
    assert load_package(out, target=target).info["signer"] == _local_fp()
    verifying.Config().use_elliptic_key_verifier(public_key=public_key_of()).verify(
        out, out / SIGNATURE)
    for other in ("README.txt", "docs/README.md"):
        (out / other).parent.mkdir(exist_ok=True)
        (out / other).write_text("x")
        with pytest.raises(PackageIntegrityError, match="is not listed"):
            load_package(out, target=target)
        (out / other).unlink()


def test_the_documented_command_forms_are_hydra_overrides():
    """``draftsmith-sign key | sign DIR | verify DIR`` reads as action= / dir= overrides."""
    from draftsmith.heads.signing import cli_overrides

    assert cli_overrides(["key"]) == ["action=key"]
    assert cli_overrides(["sign", "outputs/pkg"]) == ["action=sign", "dir='outputs/pkg'"]
    assert cli_overrides(["verify", "it's"]) == ["action=verify", "dir='it\\'s'"]
    assert cli_overrides(["action=verify", "dir=x"]) == ["action=verify", "dir=x"]
    assert cli_overrides(["--help"]) == ["--help"]
