"""What the client scripts beside this one share: plain HTTP calls to a loraplex server, a
multipart body, and an adapter upload. Standard library only."""

import json
import os
import urllib.request
import uuid


def http(base, method, path, key, body=None, content_type="application/json"):
    """One request with `Authorization: Bearer key`; the response's headers and JSON body."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", content_type)
    with urllib.request.urlopen(req) as res:
        return dict(res.headers), json.loads(res.read())


def multipart(fields):
    boundary = uuid.uuid4().hex
    out = b""
    for name, value in fields:
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n\r\n'.encode()
        out += value + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return out, f"multipart/form-data; boundary={boundary}"


def upload_adapter(base, key, name, directory):
    """Uploads the PEFT adapter in `directory` as `name`; the server's answer."""
    with open(os.path.join(directory, "adapter_config.json"), "rb") as c, open(os.path.join(directory, "adapter_model.safetensors"), "rb") as w:
        body, ctype = multipart([("name", name.encode()), ("config", c.read()), ("weights", w.read())])
    return http(base, "POST", "/v1/adapters", key, body, ctype)[1]
