# shellcheck shell=bash
# A local certificate authority shared by scripts/kafka.sh and scripts/postgres.sh (sourced, not run).
#
# The CA lives in $STOCK_LEDGER_CA_DIR (default: <state>/ca); it is created on first use only, so certificates
# issued earlier keep verifying. Server certificates name 127.0.0.1 (an IP SAN) and nothing else: a client that
# connects to "localhost" gets a hostname mismatch, which the tests use to prove that the check is on.
#
#   ca_ensure                      # create the CA if absent; prints nothing
#   ca_issue <dir> <name> [san]    # <dir>/<name>.crt and .key signed by the CA, unless already signed by it

ca_dir="${STOCK_LEDGER_CA_DIR:-${STOCK_LEDGER_STATE:-$HOME/.local/state/stock-ledger}/ca}"

ca_ensure() {
  if [[ -f "$ca_dir/ca.crt" && -f "$ca_dir/ca.key" ]]; then return; fi
  if ! command -v openssl >/dev/null; then
    if [[ "$(id -u)" != 0 ]]; then printf '[ca] openssl not found: sudo apt-get install -y openssl\n' >&2; exit 1; fi
    printf '[ca] installing Debian'"'"'s openssl package (first run only)\n' >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null
  fi
  mkdir -p "$ca_dir"
  chmod 755 "$ca_dir"  # ca.crt is public; ca.key is 0600
  printf '[ca] creating a local CA in %s (first run only)\n' "$ca_dir" >&2
  openssl req -x509 -new -newkey rsa:2048 -nodes -sha256 -days 3650 -subj "/CN=stock-ledger local CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout "$ca_dir/ca.key" -out "$ca_dir/ca.crt" 2>/dev/null
  chmod 600 "$ca_dir/ca.key"
  chmod 644 "$ca_dir/ca.crt"
}

ca_issue() {
  local dir="$1" name="$2" san="${3:-IP:127.0.0.1}"
  ca_ensure
  mkdir -p "$dir"
  # Re-issue only when the certificate is missing or was signed by another CA (e.g. the CA dir was wiped).
  if [[ -f "$dir/$name.crt" && -f "$dir/$name.key" ]] \
    && openssl verify -CAfile "$ca_dir/ca.crt" "$dir/$name.crt" >/dev/null 2>&1; then
    return
  fi
  printf '[ca] issuing %s/%s.crt (%s)\n' "$dir" "$name" "$san" >&2
  openssl req -new -newkey rsa:2048 -nodes -subj "/CN=$name" -keyout "$dir/$name.key" -out "$dir/$name.csr" 2>/dev/null
  openssl x509 -req -in "$dir/$name.csr" -CA "$ca_dir/ca.crt" -CAkey "$ca_dir/ca.key" -CAcreateserial \
    -days 825 -sha256 -out "$dir/$name.crt" \
    -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n' "$san") \
    2>/dev/null
  rm -f "$dir/$name.csr"
  chmod 600 "$dir/$name.key"
}
