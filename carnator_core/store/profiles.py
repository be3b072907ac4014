"""The calibration profiles a store holds, one per model and schedule, in one JSON document beside the entries.

Every reader checks each profile (`Profile.from_dict`): a hand-edited or damaged one is refused with the reason,
and the run falls back to the shipped thresholds. Profiles are not entries: clearing or evicting entries keeps them.
"""

from __future__ import annotations

import json

from carnator_core.judging.calibration_profile import MAX_PROFILE_BYTES, Profile, ProfileError, profile_key
from carnator_core.store.reuse_store import ReuseStore

DOCUMENT = "profiles"
MAX_PROFILES = 256
CFG_TOLERANCE = 1e-3


def _document(store: ReuseStore) -> tuple[dict, str]:
    """The raw document as a JSON object, and why it is unusable ("" when it is fine or absent)."""
    raw = store.get_document(DOCUMENT)
    if raw is None:
        return {}, ""
    if len(raw) > MAX_PROFILES * MAX_PROFILE_BYTES:
        return {}, f"the store's profile document is {len(raw)} bytes, more than any {MAX_PROFILES} profiles take"
    try:
        data = json.loads(raw, parse_constant=lambda name: float("nan"))  # NaN fields are refused per profile
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return {}, f"the store's profile document is not JSON: {error}"
    if not isinstance(data, dict):
        return {}, "the store's profile document is not a JSON object"
    return data, ""


def stored_profiles(store: ReuseStore, scope: str | None = None) -> tuple[dict[str, Profile], dict[str, str]]:
    """The usable profiles by key, and the refused ones' keys with the reason; with `scope`, that scope's alone."""
    data, problem = _document(store)
    if problem:
        return {}, {"*": problem}
    usable, refused = {}, {}
    for key, value in data.items():
        if scope is not None and _scope_of(str(key)) != scope:
            continue
        try:
            profile = Profile.from_dict(value)
        except ProfileError as error:
            refused[str(key)] = str(error)
            continue
        if profile.key != key:
            refused[str(key)] = f"filed under {key!r} but measured on {profile.key!r}"
            continue
        usable[key] = profile
    return usable, refused


def profile_for(store: ReuseStore, model: str, schedule: str, cfg: float,
                scope: str = "") -> tuple[Profile | None, str]:
    """The profile for this model, schedule and guidance scale in `scope`, or None and why none applies ("" when
    the store holds none there)."""
    usable, refused = stored_profiles(store, scope)
    key = profile_key(model, schedule, scope)
    if key in usable:
        profile = usable[key]
        if not profile.in_force:
            return None, f"{profile.describe()} is not in force ({profile.reason}): shipped thresholds"
        if abs(profile.cfg - cfg) > CFG_TOLERANCE:
            return None, f"{profile.describe()} was measured at cfg {profile.cfg:g}, this run samples at cfg " \
                         f"{cfg:g}: shipped thresholds"
        return profile, ""
    if key in refused or "*" in refused:
        return None, f"calibration profile refused ({refused.get(key) or refused['*']}): shipped thresholds"
    if any(other.model == model for other in usable.values()):
        return None, "this model's calibration profiles are for other schedules (steps, scheduler, shift): " \
                     "shipped thresholds"
    return None, ""


def _scope_of(key: str) -> str:
    """The scope a profile key is filed in (`profile_key`)."""
    return key.split("|", 1)[0] if "|" in key else ""


def save_profile(store: ReuseStore, profile: Profile) -> None:
    """File `profile` under its model and schedule, replacing the one there; unusable entries are dropped. A profile
    that fails its checks (`Profile.from_dict`) is refused with ProfileError, whoever made it."""
    Profile.from_dict(json.loads(json.dumps(profile.as_dict())))
    usable, _ = stored_profiles(store)
    usable[profile.key] = profile
    if len(usable) > MAX_PROFILES:
        oldest = min((p for k, p in usable.items() if k != profile.key), key=lambda p: p.created_at)
        del usable[oldest.key]
    document = {key: value.as_dict() for key, value in usable.items()}
    store.set_document(DOCUMENT, json.dumps(document, allow_nan=False).encode())


def delete_profile(store: ReuseStore, key: str) -> bool:
    """Remove the profile filed under `key` (unusable ones go with it); whether there was one."""
    usable, refused = stored_profiles(store)
    if key not in usable and key not in refused:
        return False
    document = {other: value.as_dict() for other, value in usable.items() if other != key}
    store.set_document(DOCUMENT, json.dumps(document, allow_nan=False).encode())
    return True
