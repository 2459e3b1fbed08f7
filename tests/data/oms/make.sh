#!/usr/bin/env bash
# Regenerates the OpenSSF model-signing fixtures of rust/verify/oms.rs (README.md says what each
# is). Needs openssl and a Python with model_signing 1.1.1 and pyopenssl (and its cryptography),
# and for the formats of older releases a Python with model_signing 0.2.0 (MS020_PYTHON) and one
# with model_signing 1.0.0 (MS100_PYTHON), each with sigstore<4: run it as
#   PATH=/path/to/venv/bin:$PATH MS020_PYTHON=... MS100_PYTHON=... tests/data/oms/make.sh
# The keys are new on every run, so every signature changes; the private keys are not kept.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python}
MS=${MODEL_SIGNING:-model_signing}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# The model: three small files, the same bytes on every run.
$PY make.py model

# Keys as the model_signing docs make them; the private halves stay in $TMP.
for k in key other; do
	openssl ecparam -name prime256v1 -genkey -noout -out "$TMP/$k.pem"
	openssl ec -in "$TMP/$k.pem" -pubout -out "$k.pub" 2>/dev/null
done
for c in 384:secp384r1 521:secp521r1; do
	openssl ecparam -name "${c#*:}" -genkey -noout -out "$TMP/key${c%%:*}.pem"
	openssl ec -in "$TMP/key${c%%:*}.pem" -pubout -out "key${c%%:*}.pub" 2>/dev/null
done
# An RSA key, which model_signing does not sign with.
openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$TMP/rsa.pem" 2>/dev/null
openssl pkey -in "$TMP/rsa.pem" -pubout -out rsa.pub

# Certificates (root -> intermediate -> leaf, and the variants), made with cryptography.
$PY make.py certs "$TMP"

# Signatures of the model through the CLI.
$MS sign key model --private_key "$TMP/key.pem" --signature key.sig
$MS sign key model --private_key "$TMP/key384.pem" --signature key384.sig
$MS sign key model --private_key "$TMP/key521.pem" --signature key521.sig
for c in cert cert-eku cert-nousage cert-expired-inter cert-ca; do
	$MS sign certificate model --private_key "$TMP/$c.key" --signing_certificate "$TMP/$c.pem" \
		--certificate_chain "$TMP/$c-chain.pem" --signature "$c.sig"
done
# A self-signed signing certificate (model_signing needs a chain file: the certificate itself).
$MS sign certificate model --private_key "$TMP/self-signed.key" --signing_certificate self-signed.pem \
	--certificate_chain self-signed.pem --signature self-signed.sig

# Signatures through the Python API (shards, blake2, blake3, ignored paths, a single file) and the
# edited and re-signed variants.
$PY make.py api "$TMP"

# The formats of older releases, each made by that release.
"${MS020_PYTHON:?a Python with model_signing==0.2.0 and sigstore<4}" make.py v020 "$TMP"
"${MS100_PYTHON:?a Python with model_signing==1.0.0 and sigstore<4}" make.py v100 "$TMP"

# What model_signing itself says of each: the CLI for the file/sha256 ones, then every fixture
# through the API with the hashing configuration it was made with.
$MS verify key model --signature key.sig --public_key key.pub
$MS verify key model --signature key384.sig --public_key key384.pub
$MS verify certificate model --signature cert.sig --certificate_chain root.pem
if $MS verify key model --signature key.sig --public_key other.pub; then
	echo "model_signing accepted key.sig with other.pub" >&2
	exit 1
fi
$PY make.py check
