"""The trajectory study's stages, one unit each (`base.Stage`): the inputs that key its record, its computation,
and its cost in the resource plan, next to each other."""
