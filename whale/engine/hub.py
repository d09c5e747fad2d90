"""Whether the Hugging Face hub can serve a model id here, asked once before the model loads.

Why: transformers reports an unreachable hub, a wrong name, a gated repository and a model missing
from the offline cache alike, as tracebacks after retries. Fetching the model's config.json (which
the load then reads from the cache) tells them apart, and one line says which. With
HF_HUB_OFFLINE set it reads only the cache, so nothing waits on a network that is not there.
"""

from __future__ import annotations

from huggingface_hub import constants, hf_hub_download
from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HFValidationError, HfHubHTTPError,
                                    LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError)

from whale.errors import ModelUnavailable

LOCAL = "set model.name to a local model folder, or to smollm2-135m (the offline default)"


def check_hub_model(name: str) -> None:
    """Raise ModelUnavailable (one line: the model and the cause) unless `name` loads from the hub or its cache."""
    url = f"{constants.ENDPOINT}/{name}"
    try:
        hf_hub_download(name, "config.json")
    except HFValidationError:
        raise ModelUnavailable(f"model '{name}' is neither a local folder nor a Hugging Face model id; "
                               f"{LOCAL}") from None
    except GatedRepoError:
        raise ModelUnavailable(f"model '{name}' is gated on the Hugging Face hub: accept its terms at {url}, then "
                               "log in (`hf auth login`, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelUnavailable(f"model '{name}' was not found on the Hugging Face hub (a misspelt id, or a private "
                               f"model that needs a login: `hf auth login` or HF_TOKEN); or {LOCAL}") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        if constants.HF_HUB_OFFLINE:
            raise ModelUnavailable(f"model '{name}' is not in the Hugging Face cache and the hub is offline "
                                   f"(HF_HUB_OFFLINE=1): download it where the hub is reachable (`hf download "
                                   f"{name}`), or {LOCAL}") from None
        cause = " ".join(str(e.__cause__ or e).split())[:200]
        raise ModelUnavailable(f"model '{name}': the Hugging Face hub cannot be reached ({cause}) and the model "
                               f"is not in the cache; check the network (or HF_ENDPOINT), or {LOCAL}") from None
    except EntryNotFoundError:
        raise ModelUnavailable(f"model '{name}' has no config.json on the Hugging Face hub, so transformers cannot "
                               f"load it; choose a transformers model ({url})") from None
    except HfHubHTTPError as e:
        raise ModelUnavailable(f"model '{name}': the Hugging Face hub answered {' '.join(str(e).split())[:200]}; "
                               "try again later, or " + LOCAL) from None
