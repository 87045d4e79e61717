#include "error.h"

namespace cudasnap {

void throw_error(ErrorKind kind, const char* file, int line,
                 const std::string& what) {
  const char* base = std::strrchr(file, '/');
  std::ostringstream os;
  os << what << " (" << (base ? base + 1 : file) << ":" << line << ")";
  throw Error(kind, os.str());
}

}  // namespace cudasnap
