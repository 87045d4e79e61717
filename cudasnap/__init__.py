from cudasnap.errors import *  # placeholder
