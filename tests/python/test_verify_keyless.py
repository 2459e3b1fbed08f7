"""Keyless (Sigstore) signatures verified offline: `Signature(sig, identity=..., issuer=...,
trusted_root=...)`, the CLI's `--identity`/`--identity-provider`/`--trusted-root` (and
model_signing's spellings), the vLLM config's names. Each verdict on the bundles of
tests/data/sigstore (made with a test CA, CT log and transparency log; README.md there) is
compared with sigstore-python's offline `Verifier` over the same trusted root, asked again here;
model_signing's own CLI verifies the same bundles offline with `--trust_config`, and is compared
too. With FST_MODEL_TRANSPARENCY_TESTS naming model_signing's scripts/tests folder, its four
keyless signatures are verified with Sigstore's production trusted root, offline."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fastsafetensors_rs as fst
from fastsafetensors_rs import SafetensorError, Signature
from fastsafetensors_rs.verify import default_trusted_root, from_config

import fst_testutils as U

sigstore = pytest.importorskip("sigstore", reason="sigstore (model-signing's dependency) is in requirements-dev.txt")
from sigstore.models import Bundle, TrustedRoot  # noqa: E402
from sigstore.verify import Verifier, policy  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "sigstore"
MODEL = DATA.parent / "oms" / "model"
ROOT = DATA / "trusted_root.json"
IDENTITY = "signer@example.com"
ISSUER = "https://issuer.example.com"
# Refused here, verified by sigstore-python: the identity is the certificate's second name; the
# two issuer extensions disagree; an RFC 3161 timestamp that does not verify (of other bytes, or
# by an authority the trusted root does not list), which sigstore-python drops
# (rust/verify/oms/keyless.rs says why).
STRICTER = {"second-san.sig", "issuer-v2-differs.sig", "timestamp-other-bytes.sig", "timestamp-unknown-tsa.sig"}


def _python_verdict(bundle: Path, identity: str, issuer: str, root: Path = ROOT) -> str:
    """'ok', or why sigstore-python's offline Verifier refuses the bundle."""
    try:
        verifier = Verifier(trusted_root=TrustedRoot.from_file(str(root)))
        verifier.verify_dsse(Bundle.from_json(bundle.read_bytes()), policy.Identity(identity=identity, issuer=issuer))
    except Exception as e:  # every refusal, whatever its class
        return f"refused: {e}"
    return "ok"


def _cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastsafetensors_rs", "verify", "--no-progress", *map(str, args)],
                          capture_output=True, text=True, env=U.subprocess_env(), cwd=cwd, timeout=120)


def _model_signing(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "model_signing", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def model(tmp_path) -> Path:
    """A copy of the model the bundles sign."""
    return Path(shutil.copytree(MODEL, tmp_path / "model"))


def _load(model: Path, bundle: str, identity: str = IDENTITY, issuer: str = ISSUER, root: Path = ROOT):
    return fst.load(str(model / "model.safetensors"),
                    verify=Signature(DATA / bundle, identity=identity, issuer=issuer, trusted_root=root))


def test_every_case_as_sigstore_python_judges_it(model):
    """Each case of cases.json loaded with `verify=` and given to sigstore-python: the same
    verdict (but the two where this verifier refuses more), each refusal one line naming the
    signature."""
    cases = json.loads((DATA / "cases.json").read_text())
    assert len(cases) == 27
    verdicts = []
    for case in cases:
        bundle, identity, issuer = case["bundle"], case["identity"], case["issuer"]
        python = _python_verdict(DATA / bundle, identity, issuer)
        assert (python == "ok") == (case["sigstore_python"] == "ok"), f"{bundle}: cases.json says otherwise: {python}"
        try:
            tensors = _load(model, bundle, identity, issuer)
            ours = "ok"
        except SafetensorError as e:
            ours = str(e)
            assert "\n" not in ours and ours.startswith(f"{DATA / bundle}: signature does not verify: "), ours
        else:
            assert set(tensors) == {"w"}
        if bundle in STRICTER:
            assert (python, ours != "ok") == ("ok", True), f"{bundle}: {ours}"
        else:
            assert (python == "ok") == (ours == "ok"), f"{bundle} ({identity}, {issuer}): {python} / {ours}"
        verdicts.append(ours == "ok")
    # good.sig, workflow.sig and timestamped.sig, with their own identity and issuer
    assert verdicts.count(True) == 3


@pytest.mark.parametrize("bundle, identity, issuer, says", [
    ("good.sig", "someone@example.com", ISSUER, "identity is signer@example.com, not someone@example.com"),
    ("good.sig", IDENTITY, "https://accounts.google.com", "OIDC issuer is https://issuer.example.com, not "
                                                          "https://accounts.google.com"),
    ("expired.sig", IDENTITY, ISSUER, "the signing certificate was not valid when the log recorded the entry: valid "
                                      "from 2025-06-01T12:00:00Z to 2025-06-01T12:10:00Z, logged at "
                                      "2025-06-01T12:11:00Z"),
    ("bad-proof.sig", IDENTITY, ISSUER, "the transparency log's inclusion proof does not verify"),
    ("bad-checkpoint.sig", IDENTITY, ISSUER, "the transparency log's checkpoint does not verify"),
    ("edited-payload.sig", IDENTITY, ISSUER, "the envelope's signature is not one made by the signing certificate's "
                                             "key of this payload"),
    ("timestamp-other-bytes.sig", IDENTITY, ISSUER, "the signing time: invalid RFC 3161 timestamp: TSA timestamp "
                                                    "verification failed: Timestamp message hash mismatch"),
    ("timestamp-unknown-tsa.sig", IDENTITY, ISSUER, "CMS signer does not match any trusted TSA certificate"),
    ("timestamp-after-expiry.sig", IDENTITY, ISSUER, "the signing certificate was not valid at the time an RFC 3161 "
                                                     "timestamp of the bundle gives: valid from 2025-06-01T12:00:00Z to "
                                                     "2025-06-01T12:10:00Z"),
])
def test_each_failure_says_what_failed(model, bundle, identity, issuer, says):
    with pytest.raises(SafetensorError) as e:
        _load(model, bundle, identity, issuer)
    assert str(e.value).startswith(f"{DATA / bundle}: signature does not verify: ")
    assert says in str(e.value) and "\n" not in str(e.value)


LOG_KEY_REFUSED = "the transparency log's signed entry timestamp does not verify: No log key valid at integrated " \
                  "time 2025-06-01T12:01:00Z"
CT_KEY_REFUSED = "the signing certificate's signed certificate timestamp does not verify"
TSA_REFUSED = "the signing time: RFC 3161 timestamp 2025-06-01T12:00:30Z is outside the validity period of the " \
              "authority that signed it"


@pytest.mark.parametrize("log, window, ours, python_ok", [
    # good.sig's SCT was made at 12:00:00.5 and its entry logged at 12:01:00 on 2025-06-01.
    ("tlogs", {"start": "2025-06-01T12:05:00Z"}, LOG_KEY_REFUSED, True),
    ("tlogs", {"start": "2025-01-01T00:00:00Z", "end": "2025-06-01T12:00:30Z"}, LOG_KEY_REFUSED, True),
    ("tlogs", {"start": "2025-01-01T00:00:00Z", "end": "2025-12-31T00:00:00Z"}, "ok", True),  # rotated since
    ("tlogs", {"start": "2999-01-01T00:00:00Z"}, LOG_KEY_REFUSED, False),
    ("ctlogs", {"start": "2025-06-01T12:05:00Z"}, CT_KEY_REFUSED, True),
    ("ctlogs", {"start": "2025-01-01T00:00:00Z", "end": "2025-06-01T11:59:00Z"}, CT_KEY_REFUSED, True),
    ("ctlogs", {"start": "2025-01-01T00:00:00Z", "end": "2025-12-31T00:00:00Z"}, "ok", True),
    ("ctlogs", {"start": "2999-01-01T00:00:00Z"}, CT_KEY_REFUSED, False),
    # timestamped.sig's RFC 3161 timestamp is of 12:00:30.
    ("timestampAuthorities", {"start": "2025-06-01T12:05:00Z"}, TSA_REFUSED, True),
    ("timestampAuthorities", {"start": "2025-01-01T00:00:00Z", "end": "2025-06-01T12:00:10Z"}, TSA_REFUSED, True),
    ("timestampAuthorities", {"start": "2025-01-01T00:00:00Z", "end": "2025-12-31T00:00:00Z"}, "ok", True),
], ids=["tlog-later", "tlog-ended", "tlog-rotated", "tlog-future", "ctlog-later", "ctlog-ended", "ctlog-rotated",
        "ctlog-future", "tsa-later", "tsa-ended", "tsa-rotated"])
def test_a_log_key_or_authority_counts_only_within_its_window_at_the_time_it_vouched_for(model, tmp_path, log, window,
                                                                                         ours, python_ok):
    """The trusted root's window of the Rekor key (`tlogs`) held against the entry's
    integrated time, the CT log key's (`ctlogs`) against the SCT's, the timestamp authority's
    against its timestamp's: one rotated out since still verifies what it signed while in
    force. sigstore-python holds only the start against the present (and drops a timestamp it
    cannot verify), so it accepts more; never the reverse."""
    root = json.loads(ROOT.read_text())
    entry = root[log][0]
    (entry if log == "timestampAuthorities" else entry["publicKey"])["validFor"] = window
    edited = tmp_path / "trusted_root.json"
    edited.write_text(json.dumps(root))
    bundle = "timestamped.sig" if log == "timestampAuthorities" else "good.sig"
    assert (_python_verdict(DATA / bundle, IDENTITY, ISSUER, edited) == "ok") == python_ok
    if ours == "ok":
        assert set(_load(model, bundle, root=edited)) == {"w"}
        return
    with pytest.raises(SafetensorError) as e:
        _load(model, bundle, root=edited)
    message = str(e.value)
    assert message.startswith(f"{DATA / bundle}: signature does not verify: {ours}") and "\n" not in message, message


def test_the_cli_and_model_signing_agree_on_a_directory(model, tmp_path):
    """`model_signing verify sigstore ARGS --trust_config C` and `fastsafetensors-rs verify ARGS`
    with the same arguments: verified; then, with our own spelling and the trusted root itself,
    one flipped byte of the model refused naming the file."""
    signing_config = next(Path(sigstore.__file__).parent.glob("_store/*sigstore.dev/signing_config*.json"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
                                  "trustedRoot": json.loads(ROOT.read_text()),
                                  "signingConfig": json.loads(signing_config.read_text())}))
    theirs = [model, "--signature", DATA / "good.sig", "--identity", IDENTITY, "--identity_provider", ISSUER,
              "--trust_config", config]
    assert _model_signing("verify", "sigstore", *theirs).returncode == 0
    ours = _cli(*theirs)
    assert ours.returncode == 0, ours.stdout + ours.stderr
    _flip(model / "model.safetensors", 100)
    ours = _cli("--signature", DATA / "good.sig", "--identity", IDENTITY, "--identity-provider", ISSUER,
                "--trusted-root", ROOT, model)
    assert ours.returncode == 1 and "changed    model.safetensors" in ours.stdout, ours.stdout + ours.stderr


def test_the_trusted_root_defaults_to_the_one_the_sigstore_package_ships(model, monkeypatch):
    shipped = Path(default_trusted_root())
    assert shipped.is_file() and shipped.parent.name == "https%3A%2F%2Ftuf-repo-cdn.sigstore.dev"
    assert Path(default_trusted_root(staging=True)).parent.name == "https%3A%2F%2Ftuf-repo-cdn.sigstage.dev"
    sig = Signature(DATA / "good.sig", identity=IDENTITY, issuer=ISSUER)
    assert sig.trusted_root == str(shipped)
    # Sigstore's production root lists none of the test services.
    assert _python_verdict(DATA / "good.sig", IDENTITY, ISSUER, shipped) != "ok"
    with pytest.raises(SafetensorError, match="transparency log the trusted root does not list"):
        fst.load(str(model / "model.safetensors"), verify=sig)
    # No sigstore package: one line saying how to get a trusted root.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"^no Sigstore trusted root: pass trusted_root=.*pip install sigstore"):
        Signature(DATA / "good.sig", identity=IDENTITY, issuer=ISSUER)
    Signature(DATA / "good.sig", identity=IDENTITY, issuer=ISSUER, trusted_root=ROOT)  # given: not looked for


def test_what_a_keyless_signature_takes():
    with pytest.raises(ValueError, match="takes both identity= .* and issuer="):
        Signature("m.sig", identity=IDENTITY, trusted_root=ROOT)
    with pytest.raises(ValueError, match="takes both identity="):
        Signature("m.sig", issuer=ISSUER, trusted_root=ROOT)
    with pytest.raises(ValueError, match="not public_key and identity=/issuer="):
        Signature("m.sig", public_key="k.pub", identity=IDENTITY, issuer=ISSUER)
    # The vLLM plugin's extra config: our names, or model_signing's.
    for config in ({"signature": "m.sig", "identity": IDENTITY, "issuer": ISSUER, "trusted_root": str(ROOT)},
                   {"signature": "m.sig", "identity": IDENTITY, "identity_provider": ISSUER,
                    "trust_config": str(ROOT), "full": True}):
        sig = from_config(config)
        assert (sig.identity, sig.issuer, sig.trusted_root) == (IDENTITY, ISSUER, str(ROOT))
    with pytest.raises(ValueError, match="give 'issuer' or 'identity_provider', not both"):
        from_config({"signature": "m.sig", "identity": IDENTITY, "issuer": ISSUER, "identity_provider": ISSUER})


def test_the_vllm_config_and_its_weights_iterator_take_it(model):
    """The vLLM plugin's extra config, in model_signing's names, then the iterator it loads with:
    every tensor out of the signed file; none once the identity is another."""
    from fastsafetensors_rs import vllm_plugin

    config = {"signature": str(DATA / "good.sig"), "identity": IDENTITY, "identity_provider": ISSUER,
              "trust_config": str(ROOT)}
    opts = vllm_plugin.parse_options({"verify": config})
    files = [str(model / "model.safetensors")]
    assert [n for n, _ in fst.weights_iterator(files, verify=opts["verify"])] == ["w"]
    opts = vllm_plugin.parse_options({"verify": {**config, "identity": "someone@example.com"}})
    with pytest.raises(SafetensorError, match="identity is signer@example.com, not someone@example.com"):
        list(fst.weights_iterator(files, verify=opts["verify"]))
    with pytest.raises(ValueError, match=r"model_loader_extra_config\['verify'\].*takes both identity="):
        vllm_plugin.parse_options({"verify": {"signature": "m.sig", "identity": IDENTITY, "trusted_root": str(ROOT)}})


# ------------------------------------------------------------------------- model_signing's own signatures

REFERENCE = os.environ.get("FST_MODEL_TRANSPARENCY_TESTS")
IBM = ("stefanb@us.ibm.com", "https://sigstore.verify.ibm.com/oauth2")


@pytest.mark.skipif(not REFERENCE, reason="FST_MODEL_TRANSPARENCY_TESTS names model_signing's scripts/tests folder "
                                          "(sigstore/model-transparency), whose files are not ours to ship")
def test_model_signings_own_keyless_signatures_offline_with_the_production_root(tmp_path):
    """The four keyless signatures of model_signing's repository (v0.3.1 to v1.1.0), verified as
    its test-verify-*-sigstore.sh scripts verify them, with the production trusted root the
    sigstore package ships and no network; sigstore-python's offline Verifier says the same of
    each bundle. Then one flipped byte of each model, refused naming the file."""
    tests = tmp_path / "tests"
    shutil.copytree(REFERENCE, tests)
    runs = []
    for version in ["v0.3.1", "v1.0.0", "v1.0.1", "v1.1.0"]:
        name = f"{version}-sigstore"
        ignore = ["--ignore-paths", f"./{name}/ignore-me"] if version >= "v1.0.1" else []
        runs.append((name, [*ignore, "--signature", f"./{name}/model.sig", "--identity", IBM[0],
                            "--identity_provider", IBM[1], f"./{name}/"]))
    for name, args in runs:
        assert _python_verdict(tests / name / "model.sig", *IBM, Path(default_trusted_root())) == "ok", name
        ours = _cli(*args, cwd=tests)
        assert ours.returncode == 0, f"{name}: {ours.stdout}{ours.stderr}"
    for name, args in runs:
        _flip(tests / name / "signme-1", 0)
        ours = _cli(*args, cwd=tests)
        assert ours.returncode == 1 and "changed    signme-1" in ours.stdout, f"{name}: {ours.stdout}"
