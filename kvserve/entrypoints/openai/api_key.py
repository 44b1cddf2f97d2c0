"""Which API keys a client can send (a light module: the router and the flag checks import it)."""

from __future__ import annotations


def api_key_problem(key: str) -> str | None:
    """Why no client could send `key` as it is in an `Authorization: Bearer` header, or None when one can: a
    control character (a key file's or secret's last newline, say), space at either end (header values are
    trimmed) or a character outside ASCII (HTTP clients send header values as ASCII or Latin-1 bytes). A server
    with such a key answered 401 to every request (failed with an error for one outside ASCII); a router could not
    send it."""
    if any(ord(c) < 32 and c != "\t" or ord(c) == 127 for c in key):
        return ("the API key holds a control character (a line end, say, such as a key file's or secret's last "
                "newline): it cannot be sent in an Authorization header")
    if key != key.strip():
        return "the API key starts or ends with white space, which HTTP trims from a header: no request could match it"
    if not key.isascii():
        return "the API key holds a character outside ASCII, which HTTP clients cannot send in a header as it is"
    return None
