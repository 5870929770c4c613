"""What a session's worker groups leave under its output URI (<output_uri>/<session id>):

    states/<name>/                    save_state: weights, Adam moments and step (load_state and a new group read it)
    weights/<name>/<call number>/     save_weights: a PEFT adapter; each save its own folder, because Serve replicas
                                      cache adapters by URI: a second save under one name must not reuse the first's
                                      (the control plane serves a name's newest save)
"""

from __future__ import annotations

from moetune.api import storage


def state_uri(output_uri: str, name: str) -> str:
    return storage.join(output_uri, "states", name)


def weights_uri(output_uri: str, name: str, call_number: int) -> str:
    """`call_number`: the save's place among the session's calls, unique across its worker groups."""
    return storage.join(output_uri, "weights", name, str(call_number))
