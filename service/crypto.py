"""Secrets at rest: AES-256-GCM with keys derived from the server's `secret_key` (HKDF-SHA256).

A stored value is `enc1:<key id>:<base64url(nonce || ciphertext || tag)>`. The key id is a fingerprint
of the derived key (never the key), so values written under `PEAGLE_SECRET_KEY_PREVIOUS` are still read
after a rotation, and `needs_rewrap` tells which ones to re-encrypt under the current key. The
associated data (e.g. the webhook endpoint id) binds a value to its row: copied to another row, it no
longer decrypts. A value without the `enc1:` prefix is legacy plaintext (written before encryption
existed): it is returned as is and reported by `needs_rewrap`.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["PREFIX", "SecretBox", "SecretError"]

PREFIX = "enc1"


class SecretError(ValueError):
    """A stored secret cannot be decrypted with any configured key."""


def _derive(secret_key: str, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret_key.encode())


def _kid(key: bytes) -> str:
    return hashlib.sha256(b"peagle key id\x00" + key).hexdigest()[:8]


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SecretBox:
    """Encrypts under the current key; decrypts under the current or any previous key."""

    def __init__(self, secret_key: str, previous: Iterable[str] = (), *, info: bytes) -> None:
        self._current = _derive(secret_key, info)
        self.key_id = _kid(self._current)
        self._keys = {self.key_id: self._current}
        for old in previous:
            if old:
                key = _derive(old, info)
                self._keys.setdefault(_kid(key), key)

    def encrypt(self, plaintext: str, *, aad: bytes) -> str:
        nonce = os.urandom(12)
        ct = AESGCM(self._current).encrypt(nonce, plaintext.encode(), aad)
        return f"{PREFIX}:{self.key_id}:{_b64(nonce + ct)}"

    def decrypt(self, stored: str, *, aad: bytes) -> str:
        if not stored.startswith(PREFIX + ":"):
            return stored  # legacy plaintext (see needs_rewrap)
        try:
            _, kid, blob = stored.split(":", 2)
            raw = _unb64(blob)
        except ValueError:
            raise SecretError("malformed encrypted secret") from None
        key = self._keys.get(kid)
        if key is None:
            raise SecretError(f"secret encrypted under unknown key id {kid} (set PEAGLE_SECRET_KEY_PREVIOUS?)")
        try:
            return AESGCM(key).decrypt(raw[:12], raw[12:], aad).decode()
        except (InvalidTag, ValueError):
            raise SecretError("encrypted secret does not verify (wrong key or row)") from None

    def needs_rewrap(self, stored: str) -> bool:
        """True for plaintext values and values under a previous key."""
        return not stored.startswith(f"{PREFIX}:{self.key_id}:")
