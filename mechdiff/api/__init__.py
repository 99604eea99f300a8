"""The Python door (``import mechdiff as md``): the names `mechdiff` exports, each defined in one module here
(`.inputs`: models, tasks, tokens; `.study`: a study, its plan; `.results`: what a run wrote; `.compare`: circuits
scored in several models; `.view`: a results directory's page). Each calls the functions the commands call;
nothing here is a second implementation. This package imports none of its modules itself, so ``import mechdiff``
stays as cheap as the CLI needs (`mechdiff.__getattr__` imports one on first use)."""
