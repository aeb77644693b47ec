{{/* Names and labels shared by the chart's objects. */}}

{{- define "hybridflow.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Cluster-scoped objects (ClusterRoles, ClusterRoleBindings) carry the release's namespace too: two
releases of one name in two namespaces must not claim one object (Helm refuses an object another
release owns). */}}
{{- define "hybridflow.clusterScopedName" -}}
{{- printf "%s-%s" (include "hybridflow.fullname" .) .Release.Namespace | trunc 253 | trimSuffix "-" -}}
{{- end -}}

{{- define "hybridflow.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "hybridflow.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: hybridflow
{{ include "hybridflow.selectorLabels" . }}
{{- end -}}

{{- define "hybridflow.serviceAccountName" -}}
{{- default (include "hybridflow.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "hybridflow.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The namespaces the operator watches when not cluster-wide: the list, or the release's. */}}
{{- define "hybridflow.watchedNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- join "," .Values.watch.namespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/*
What the operator does through the API, as RBAC rules. Derived from its code by
tests/unit/test_helm_chart.py (every call of the Kubernetes client, every kopf watch, and the
permissions the job Role it creates grants, which it must hold itself): no more, no less.
*/}}
{{- define "hybridflow.rules" -}}
- apiGroups: ["hybridflow.io"]
  resources: ["rlhfjobs"]
  verbs: ["get", "list", "watch", "delete"]
- apiGroups: ["hybridflow.io"]
  resources: ["rlhfjobs/status"]
  verbs: ["get", "patch"]
# Every child's owner reference sets blockOwnerDeletion, which OwnerReferencesPermissionEnforcement
# (on by default in OpenShift) allows only to who may update the owner's finalizers.
- apiGroups: ["hybridflow.io"]
  resources: ["rlhfjobs/finalizers"]
  verbs: ["update"]
# A queued job is held and released through its Kueue Workload's spec.active.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "patch"]
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["serviceaccounts", "services"]
  verbs: ["get", "list", "watch", "create"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create"]
{{- end -}}

{{/*
Leader election (hybridflow_operator.leader): read, create and renew (replace) one Lease in the
release's namespace. Also derived from the code by the chart's tests.
*/}}
{{- define "hybridflow.leaderElectionRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "create", "update"]
{{- end -}}


{{/* The KubeRay operator's pod labels as key=value,key=value (HYBRIDFLOW_KUBERAY_POD_LABELS). */}}
{{- define "hybridflow.kuberayPodLabels" -}}
{{- $pairs := list -}}
{{- range $key, $value := .Values.kuberayOperatorPodLabels -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}


{{/* Cluster-scoped, in every mode: the CRDs, to learn which KubeRay is installed and to watch it
appear (kopf starts watching a resource when its CRD appears); the namespaces, which kopf lists and
watches when it serves named namespaces (without them it retries for a minute before each start). */}}
{{- define "hybridflow.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end -}}

{{/* The CRD's capabilities allow-list (CEL list items), from podSecurity.allowedCapabilities. */}}
{{- define "hybridflow.allowedCapabilities" -}}
{{- $quoted := list -}}
{{- range .Values.podSecurity.allowedCapabilities -}}
{{- $quoted = append $quoted (printf "'%s'" .) -}}
{{- end -}}
{{- join ", " $quoted -}}
{{- end -}}
