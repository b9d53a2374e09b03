#!/usr/bin/env bash
# A test certificate authority for a local cluster's mutual TLS (rpc/tls.h; docs/security.md):
#   DIR/ca.pem, ca.key                the CA
#   DIR/node.pem, node.key            moe-controller and moe-rankd (server and client auth)
#   DIR/operator.pem, operator.key    moectl and engines over TCP (client auth)
# Every certificate names 127.0.0.1, ::1, localhost and this host's name, and the DNS names in
# MOE_CA_DNS (comma-separated, e.g. the Kubernetes services':
# "moe-controller.moe.svc,*.moe-rank.moe.svc.cluster.local"). EC P-256 keys, valid for DAYS
# (default 30). Not for production: the CA key sits next to the certificates.
#   tools/make_test_ca.sh DIR [DAYS]
set -euo pipefail
dir="$1" days="${2:-30}"
mkdir -p "$dir"
cd "$dir"
host="$(hostname 2>/dev/null || echo localhost)"
extra=""
IFS=',' read -r -a dns <<<"${MOE_CA_DNS:-}"
for d in "${dns[@]}"; do
  case "$d" in
    "") ;;
    *[!A-Za-z0-9.*-]*) echo "make_test_ca.sh: MOE_CA_DNS: bad name '$d'" >&2; exit 2 ;;
    *) extra="$extra,DNS:$d" ;;
  esac
done
openssl ecparam -name prime256v1 -genkey -noout -out ca.key 2>/dev/null
openssl req -x509 -new -key ca.key -sha256 -days "$days" -subj "/CN=moe-runtime test CA $(date +%s%N)" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.pem 2>/dev/null
issue() {  # NAME USAGE
  openssl ecparam -name prime256v1 -genkey -noout -out "$1.key" 2>/dev/null
  openssl req -new -key "$1.key" -subj "/CN=$1" -out "$1.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost,DNS:%s%s\nextendedKeyUsage=%s\nkeyUsage=critical,digitalSignature,keyEncipherment\nbasicConstraints=CA:FALSE\n' \
    "$host" "$extra" "$2" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -sha256 -days "$days" -extfile "$1.ext" \
    -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
issue node serverAuth,clientAuth
issue operator clientAuth
chmod 600 ./*.key
echo "test CA in $dir: ca.pem, node.pem/.key, operator.pem/.key"
