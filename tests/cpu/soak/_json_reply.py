# SPDX-License-Identifier: Apache-2.0
"""The JSON answer both CPU stand-in servers give (the soak's ``_standin.py``, run as a script
from this folder, and request_checks' scripted server)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JSONReplyHandler(BaseHTTPRequestHandler):
    """A request handler that answers with a JSON body and keeps quiet about each request."""

    def log_message(self, *args):
        pass

    def reply_json(self, code: int, data: dict) -> None:
        body = json.dumps(data).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
